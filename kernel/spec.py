"""Pipeline files: decode strictly, validate the whole graph, report every error at once."""

from __future__ import annotations

import reprlib
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from unikern import messages as m
from unikern.errors import ConfigError
from unikern.frontends.http.params import check_server_section
from unikern.registry import resolve, stage_types

# What the engine facade injects and what it collects: the pipeline's two open ends.
INGRESS_TYPES: tuple[type, ...] = (m.Submit, m.Cancel)
EGRESS_TYPES: tuple[type, ...] = (m.TokenEvent, m.DoneEvent, m.ErrorEvent, m.EventBatch)
# the section name `--set` reaches the pipeline file's `server:` settings by
SERVER = "server"


class StageSpec(msgspec.Struct, frozen=True):
    type: str
    params: dict[str, Any]
    kind: str = "stage"  # or "service", from the type's class


class PipelineSpec(msgspec.Struct, frozen=True):
    name: str
    description: str
    stages: dict[str, StageSpec]  # every member, stages and services, in file order
    source: str
    # the HTTP front door's settings (host, port, limits): one file describes a deployment
    server: dict[str, Any] = {}

    @property
    def services(self) -> list[str]:
        return [name for name, spec in self.stages.items() if spec.kind == "service"]

    def stage_classes(self) -> dict[str, Any]:
        return {name: resolve(stage.type) for name, stage in self.stages.items()}


class PipelineErrors(ConfigError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def builtin_pipelines() -> list[str]:
    root = resources.files("unikern.pipelines")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def read_pipeline_text(pipeline: str) -> tuple[str, str]:
    """A path to a YAML file or the name of a built-in pipeline -> (text, source)."""
    path = Path(pipeline)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"pipeline file {pipeline!r} does not exist")
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as exc:
            raise PipelineErrors(str(path), [f"$: the file is not UTF-8 text (byte {exc.start})"]) from None
    names = builtin_pipelines()
    if pipeline not in names:
        raise ConfigError(
            f"unknown pipeline {pipeline!r}: not a file, and not a built-in one "
            f"({', '.join(names)})"
        )
    text = resources.files("unikern.pipelines").joinpath(f"{pipeline}.yaml").read_text("utf-8")
    return text, f"builtin:{pipeline}"


def load_pipeline(
    pipeline: str,
    *,
    model: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> PipelineSpec:
    text, source = read_pipeline_text(pipeline)
    return parse_pipeline(text, source=source, model=model, overrides=overrides)


def parse_overrides(assignments: list[str]) -> dict[str, dict[str, Any]]:
    """`STAGE.KEY=VALUE` strings -> {stage: {key: value}}; values are YAML scalars. STAGE
    is a member's name, or `server` for the server section."""
    result: dict[str, dict[str, Any]] = {}
    problems = []
    for item in assignments:
        target, eq, raw = item.partition("=")
        stage, dot, key = target.partition(".")
        if not eq or not dot or not stage or not key:
            problems.append(
                f"--set {item!r}: expected STAGE.KEY=VALUE, e.g. kv.memory_fraction=0.2 or server.max_waiting=2"
            )
            continue
        try:
            value = msgspec.yaml.decode(raw.encode()) if raw else ""
        except msgspec.DecodeError:
            value = raw
        result.setdefault(stage, {})[key] = value
    if problems:
        raise PipelineErrors("command line", problems)
    return result


def parse_pipeline(
    text: str,
    *,
    source: str = "<pipeline>",
    model: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> PipelineSpec:
    problems: list[str] = []
    try:
        raw = msgspec.yaml.decode(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise PipelineErrors(source, [f"$: the text is not valid Unicode (character {exc.start})"]) from None
    except msgspec.DecodeError as exc:
        raise PipelineErrors(source, [f"$: not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise PipelineErrors(source, [f"$: expected a mapping, got {type(raw).__name__}"])

    allowed_top = {"name", "description", "stages", "services", "server"}
    for key in raw:
        if key not in allowed_top:
            problems.append(f"$.{key}: unknown field; valid fields: {', '.join(sorted(allowed_top))}")
    name = raw.get("name", Path(source).stem)
    if not isinstance(name, str):
        problems.append(f"$.name: expected a string, got {type(name).__name__}")
        name = str(name)
    description = raw.get("description", "")
    if not isinstance(description, str):
        problems.append(f"$.description: expected a string, got {type(description).__name__}")
        description = ""
    raw_stages = raw.get("stages")
    if not isinstance(raw_stages, dict) or not raw_stages:
        problems.append("$.stages: expected a non-empty mapping of stage name -> {type: ..., ...}")
        raise PipelineErrors(source, problems)
    raw_services = raw.get("services") or {}
    if not isinstance(raw_services, dict):
        problems.append("$.services: expected a mapping of service name -> {type: ..., ...}")
        raw_services = {}
    for both in sorted(set(raw_services) & set(raw_stages)):
        problems.append(f"$.services.{both}: the name {both!r} is also a stage; member names are unique")
    section = {name: "services" for name in raw_services}
    raw_stages = {**raw_stages, **{k: v for k, v in raw_services.items() if k not in raw_stages}}
    server = raw.get("server") or {}
    if not isinstance(server, dict):
        problems.append(f"$.server: expected a mapping of server settings, got {type(server).__name__}")
        server = {}
    problems += check_server_section(server)

    overrides = dict(overrides or {})
    if SERVER in overrides:  # `--set server.KEY=VALUE`: the server section, over the file's
        if SERVER in raw_stages:
            problems.append(f"--set {SERVER}.*: ambiguous: a member is named {SERVER!r} too; rename it")
        given = overrides.pop(SERVER)
        problems += check_server_section(given, path=f"--set {SERVER}")
        server = {**server, **given}
    for stage_name in overrides:
        if stage_name not in raw_stages:
            problems.append(
                f"--set {stage_name}.*: no stage named {stage_name!r}; stages: {', '.join(raw_stages)}; "
                f"or `{SERVER}` for the server section"
            )

    stages: dict[str, StageSpec] = {}
    classes: dict[str, Any] = {}
    converted: dict[str, Any] = {}  # each member's params, for checks across members
    valid_types = ", ".join(sorted(stage_types()))
    for stage_name, body in raw_stages.items():
        path = f"$.{section.get(stage_name, 'stages')}.{stage_name}"
        if not isinstance(body, dict):
            problems.append(f"{path}: expected a mapping with a `type`, got {type(body).__name__}")
            continue
        body = dict(body)
        type_name = body.pop("type", None)
        if type_name is None:
            problems.append(f"{path}.type: missing; valid types: {valid_types}")
            continue
        try:
            cls = resolve(str(type_name))
        except ConfigError:
            problems.append(f"{path}.type: unknown stage type {type_name!r}; valid types: {valid_types}")
            continue
        classes[stage_name] = cls  # the graph is checked even if params are wrong
        kind = getattr(cls, "kind", "stage")
        if section.get(stage_name) == "services" and kind != "service":
            problems.append(
                f"{path}.type: {type_name!r} is a stage (it consumes messages); list it under `stages`"
            )
        body.update(overrides.get(stage_name, {}))
        fields = {f.name: f for f in msgspec.structs.fields(cls.Params)}
        if model is not None and "model" in fields:
            body["model"] = model
        params, stage_problems = _convert_params(cls.Params, fields, body, path)
        problems += stage_problems
        if params is not None:
            stages[stage_name] = StageSpec(type=str(type_name), params=body, kind=kind)
            converted[stage_name] = params
    problems += _check_graph(classes)
    if not problems:  # settings one member refuses in the others (its `pipeline_problems`)
        for stage_name, cls in classes.items():
            check = getattr(cls, "pipeline_problems", None)
            path = f"$.{section.get(stage_name, 'stages')}.{stage_name}"
            problems += [f"{path}: {p}" for p in (check(converted) if check is not None else [])]
    if problems:
        raise PipelineErrors(source, problems)
    return PipelineSpec(name=name, description=description, stages=stages, source=source, server=server)


def _convert_params(params_cls, fields, body, path) -> tuple[Any, list[str]]:
    problems = []
    for key, value in body.items():
        if key not in fields:
            valid = ", ".join(["type", *sorted(fields)])
            problems.append(f"{path}.{key}: unknown field; valid fields: {valid}")
            continue
        try:
            msgspec.convert(value, fields[key].type)
        except (msgspec.ValidationError, TypeError) as exc:
            choices = _choices(fields[key].type)
            hint = f"; valid values: {', '.join(map(str, choices))}" if choices else ""
            problems.append(f"{path}.{key}: {_plain(exc)} (got {_short_repr(value)}){hint}")
    if problems:
        return None, problems
    try:
        params = msgspec.convert(body, params_cls)
    except msgspec.ValidationError as exc:
        return None, [f"{path}: {exc}"]
    problems += [f"{path}.{p}" for p in params.validate()]
    return (params if not problems else None), problems


def _choices(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return ()


def _short_repr(value: Any, limit: int = 80) -> str:
    """repr of a YAML value, cut short: aliases can make a tiny file expand enormously."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict = 3, 6, 6
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(exc: Exception) -> str:
    return str(exc).split(" - at ")[0]


def _check_graph(classes: dict[str, Any]) -> list[str]:
    problems = []
    consumers: dict[type, list[str]] = {}
    producers: dict[type, list[str]] = {t: ["<engine>"] for t in INGRESS_TYPES}
    for name, cls in classes.items():
        for t in cls.consumes:
            consumers.setdefault(t, []).append(name)
        for t in cls.produces:
            producers.setdefault(t, []).append(name)
    for t in EGRESS_TYPES:
        consumers.setdefault(t, []).append("<engine>")
    for t, names in consumers.items():
        if len(names) > 1:
            problems.append(f"$.stages: message {t.__name__} has several consumers: {', '.join(names)}")
        if t not in producers and names != ["<engine>"]:
            problems.append(
                f"$.stages.{names[0]}: consumes {t.__name__}, but no stage produces it"
            )
    for t, names in producers.items():
        if t not in consumers:
            who = "the engine" if names[0] == "<engine>" else f"stage {names[0]!r}"
            problems.append(
                f"$.stages: {who} produces {t.__name__}, but no stage consumes it; "
                f"stage types that do: {', '.join(_types_consuming(t)) or 'none'}"
            )
    provided = providers(classes)
    for name, cls in classes.items():
        if getattr(cls, "kind", "stage") == "service" and (cls.consumes or cls.produces):
            problems.append(f"$.services.{name}: a service consumes and produces no messages")
        for key in (*cls.requires, *getattr(cls, "uses", ())):
            if key not in provided:
                problems.append(
                    f"$.stages.{name}: requires resource {key!r}, which no stage provides"
                    f" (provided: {', '.join(sorted(provided)) or 'none'})"
                )
    if not problems:
        try:
            start_order(classes)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def _types_consuming(message_type: type) -> list[str]:
    found = []
    for name in sorted(stage_types()):
        try:
            if message_type in resolve(name).consumes:
                found.append(name)
        except Exception:  # a broken third-party stage must not hide the real problem
            continue
    return found


def providers(classes: dict[str, Any]) -> dict[str, str]:
    """Each resource key -> the member that provides it."""
    return {key: name for name, cls in classes.items() for key in cls.provides}


def start_order(classes: dict[str, Any]) -> list[str]:
    """Stages ordered so that each starts after the providers of what it requires."""
    provided = providers(classes)
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ConfigError(f"$.stages: resource requirements form a cycle through {name!r}")
        visiting.add(name)
        for key in classes[name].requires:
            visit(provided[key])
        visiting.discard(name)
        order.append(name)

    for name in classes:
        visit(name)
    return order
