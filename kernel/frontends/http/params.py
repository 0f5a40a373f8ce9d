"""The HTTP front door's settings: the pipeline file's `server:` section, then CLI flags."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

Meta = msgspec.Meta


class ServerParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    # when set, /v1/* needs `Authorization: Bearer KEY` or `x-api-key: KEY`
    api_key: str | None = None
    # the id /v1/models reports (default: the --model value as given, or `default`)
    served_model_name: str | None = None
    # requests submitted but not yet producing tokens; one more gets 429 + Retry-After
    max_waiting: Annotated[int, Meta(ge=1)] = 256
    retry_after_seconds: Annotated[int, Meta(ge=1)] = 1
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 << 20
    # on SIGTERM/SIGINT: stop accepting, let requests in flight run this long, then cancel
    drain_seconds: Annotated[float, Meta(ge=0)] = 30.0

    def with_overrides(self, **flags: Any) -> ServerParams:
        """Flags given on the command line (not None) replace the file's values."""
        given = {k: v for k, v in flags.items() if v is not None}
        return msgspec.structs.replace(self, **given) if given else self


def check_server_section(raw: dict[str, Any], path: str = "$.server") -> list[str]:
    """Problems of a `server:` section (or of `--set server.*`), each with its `<path>.<field>`."""
    fields = {f.name: f.type for f in msgspec.structs.fields(ServerParams)}
    problems = []
    for key, value in raw.items():
        if key not in fields:
            problems.append(f"{path}.{key}: unknown field; valid fields: {', '.join(sorted(fields))}")
            continue
        try:
            msgspec.convert({key: value}, ServerParams)
        except msgspec.ValidationError as exc:
            detail = str(exc).split(" - at ")[0]
            problems.append(f"{path}.{key}: {detail} (got {value!r})")
    return problems


def server_params(raw: dict[str, Any]) -> ServerParams:
    """A checked `server:` section (parse_pipeline has reported any problem already)."""
    return msgspec.convert(raw, ServerParams)
