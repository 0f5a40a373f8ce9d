"""The HTTP front door's settings: the pipeline file's `server:` section, then CLI flags."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

Meta = msgspec.Meta


class ServerParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The pipeline file's `server:` section: what `unikern serve` listens on and admits."""

    host: str = "127.0.0.1"
    """Address to listen on; `0.0.0.0` listens on every interface. The `--host` flag wins."""
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    """TCP port to listen on, 0 to 65535; 0 picks a free one (announced on stderr). The `--port` flag wins."""
    api_key: str | None = None
    """When set, `/v1/*` requires `Authorization: Bearer KEY` or `x-api-key: KEY`; null: no key asked.
    The `--api-key` flag wins."""
    served_model_name: str | None = None
    """The model id `/v1/models` reports and responses carry; null: the `--model` value as given, or `default`."""
    max_waiting: Annotated[int, Meta(ge=1)] = 256
    """Requests admitted but not yet producing tokens, at most (>= 1); one more gets HTTP 429 with
    Retry-After at once."""
    retry_after_seconds: Annotated[int, Meta(ge=1)] = 1
    """The Retry-After header of a 429 answer, in seconds (>= 1)."""
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 4 << 20
    """Largest request body accepted, in bytes (>= 1024); a larger one gets HTTP 413."""
    drain_seconds: Annotated[float, Meta(ge=0)] = 30.0
    """On SIGTERM or SIGINT: stop accepting, let requests in flight run this many seconds (>= 0), then
    cancel them. The `--drain-seconds` flag wins."""

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
