"""Pipeline spec: strict decoding, every problem reported at once, graph checks, overrides.

Unit tests of `unikern.spec` (parse_pipeline, load_pipeline, parse_overrides, start_order):
nothing here loads a model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unikern.errors import ConfigError
from unikern.spec import (
    PipelineErrors,
    PipelineSpec,
    builtin_pipelines,
    load_pipeline,
    parse_overrides,
    parse_pipeline,
    start_order,
)

VALID_TYPES = (
    "disk_tier, kv_manager, mlx_execute, offload_mover, output, schedule, schedule_tiered, tokenize"
)

# the built-in `generate` pipeline, spelled out so each test can break one thing
STAGES = {
    "tokenize": "  tokenize:\n    type: tokenize\n",
    "schedule": "  schedule:\n    type: schedule\n    max_num_seqs: 8\n    max_num_batched_tokens: 64\n",
    "kv": "  kv:\n    type: kv_manager\n    block_size: 256\n    kernel_block_size: 16\n",
    "execute": "  execute:\n    type: mlx_execute\n",
    "output": "  output:\n    type: output\n",
}


def pipeline(
    *,
    drop: tuple[str, ...] = (),
    extra: str = "",
    top: str = "",
    replace: dict[str, str] | None = None,
) -> str:
    stages = {**STAGES, **(replace or {})}
    body = "".join(text for name, text in stages.items() if name not in drop)
    return f"name: t\n{top}stages:\n{body}{extra}"


def problems_of(text: str, **kwargs) -> list[str]:
    with pytest.raises(PipelineErrors) as info:
        parse_pipeline(text, **kwargs)
    problems = info.value.problems
    # the exception message lists every problem too, with the right count
    message = str(info.value)
    assert f"{len(problems)} problem(s)" in message
    for p in problems:
        assert p in message
    return problems


# ---- the valid pipeline ---------------------------------------------------------------


def test_a_valid_pipeline_parses() -> None:
    spec = parse_pipeline(pipeline(), source="t.yaml")
    assert isinstance(spec, PipelineSpec)
    assert spec.name == "t"
    assert list(spec.stages) == ["tokenize", "schedule", "kv", "execute", "output"]
    assert spec.stages["kv"].type == "kv_manager"
    assert spec.stages["schedule"].params == {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    assert spec.source == "t.yaml"


def test_every_builtin_pipeline_validates() -> None:
    names = builtin_pipelines()
    assert "generate" in names
    for name in names:
        spec = load_pipeline(name)
        assert spec.source == f"builtin:{name}"
        assert spec.stages


def test_builtin_generate_is_the_documented_one() -> None:
    spec = load_pipeline("generate")
    assert spec.name == "generate"
    assert {n: s.type for n, s in spec.stages.items()} == {
        "tokenize": "tokenize",
        "schedule": "schedule",
        "kv": "kv_manager",
        "execute": "mlx_execute",
        "output": "output",
    }
    assert (
        spec.stages["kv"].params["block_size"] % spec.stages["kv"].params["kernel_block_size"] == 0
    )


def test_start_order_puts_providers_first() -> None:
    spec = load_pipeline("generate")
    order = start_order(spec.stage_classes())
    assert sorted(order) == sorted(spec.stages)
    # execute provides `model`, kv needs it; tokenize provides `tokenizer`; schedule needs all
    assert order.index("execute") < order.index("kv") < order.index("schedule")
    assert order.index("tokenize") < order.index("schedule")
    assert order.index("tokenize") < order.index("output")


def test_start_order_reports_a_resource_cycle() -> None:
    class A:
        provides = ("a",)
        requires = ("b",)

    class B:
        provides = ("b",)
        requires = ("a",)

    with pytest.raises(ConfigError, match="cycle"):
        start_order({"x": A, "y": B})


# ---- every problem at once ----------------------------------------------------------


def test_every_problem_is_reported_at_once() -> None:
    text = pipeline(
        top="bogus_key: 1\ndescription: [not, a, string]\n",
        extra=("  mystery:\n    type: nosuch\n  untyped:\n    foo: 1\n  scalar: 5\n"),
    )
    problems = problems_of(text, overrides={"ghost": {"x": 1}})
    assert len(problems) == 6, problems
    joined = "\n".join(problems)
    assert "$.bogus_key: unknown field; valid fields: description, name, server, services, stages" in joined
    assert "$.description: expected a string, got list" in joined
    assert (
        f"$.stages.mystery.type: unknown stage type 'nosuch'; valid types: {VALID_TYPES}" in joined
    )
    assert f"$.stages.untyped.type: missing; valid types: {VALID_TYPES}" in joined
    assert "$.stages.scalar: expected a mapping with a `type`, got int" in joined
    assert "--set ghost.*: no stage named 'ghost'" in joined


def test_parameter_problems_in_several_stages_are_all_reported() -> None:
    text = pipeline(
        replace={
            "schedule": "  schedule:\n    type: schedule\n    max_num_seqs: many\n",
            "kv": "  kv:\n    type: kv_manager\n    block_sise: 256\n    allocation: sometimes\n",
        }
    )
    joined = "\n".join(problems_of(text))
    assert "$.stages.schedule.max_num_seqs: Expected `int`, got `str` (got 'many')" in joined
    assert (
        "$.stages.kv.block_sise: unknown field; valid fields: type, activation_reserve_bytes, allocation, block_size"
        in joined
    )
    assert "$.stages.kv.allocation: " in joined


def test_a_bad_choice_names_the_valid_options() -> None:
    text = pipeline(replace={"kv": "  kv:\n    type: kv_manager\n    allocation: sometimes\n"})
    [problem] = [p for p in problems_of(text) if p.startswith("$.stages.kv.allocation:")]
    assert "lazy" in problem and "eager" in problem


def test_cross_field_checks_name_the_field() -> None:
    text = pipeline(
        replace={
            "kv": "  kv:\n    type: kv_manager\n    block_size: 100\n    kernel_block_size: 16\n"
        }
    )
    joined = "\n".join(problems_of(text))
    assert "$.stages.kv.block_size: 100 is not a whole multiple of kernel_block_size 16" in joined


def test_one_bad_parameter_is_one_problem() -> None:
    text = pipeline(
        replace={
            "kv": "  kv:\n    type: kv_manager\n    block_size: 100\n    kernel_block_size: 16\n"
        }
    )
    assert len(problems_of(text)) == 1
    text = pipeline(
        replace={"schedule": "  schedule:\n    type: schedule\n    max_num_seqs: many\n"}
    )
    assert len(problems_of(text)) == 1


# ---- structure ----------------------------------------------------------------------


def test_unknown_top_level_keys() -> None:
    problems = problems_of(pipeline(top="stagez: {}\nversion: 2\n"))
    assert problems == [
        "$.stagez: unknown field; valid fields: description, name, server, services, stages",
        "$.version: unknown field; valid fields: description, name, server, services, stages",
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("stages: [tokenize, schedule]\n", "$.stages: expected a non-empty mapping"),
        ("stages: {}\n", "$.stages: expected a non-empty mapping"),
        ("stages: tokenize\n", "$.stages: expected a non-empty mapping"),
        ("name: x\n", "$.stages: expected a non-empty mapping"),
        ("- just\n- a list\n", "$: expected a mapping, got list"),
        ("stages: {a: [\n", "$: not valid YAML"),
    ],
)
def test_non_mapping_stages(text: str, expected: str) -> None:
    problems = problems_of(text)
    assert len(problems) == 1
    assert problems[0].startswith(expected)


def test_a_stage_body_that_is_not_a_mapping() -> None:
    problems = problems_of(pipeline(replace={"output": "  output: output\n"}))
    assert "$.stages.output: expected a mapping with a `type`, got str" in problems


def test_missing_type() -> None:
    problems = problems_of(pipeline(replace={"output": "  output:\n    stop: []\n"}))
    assert f"$.stages.output.type: missing; valid types: {VALID_TYPES}" in problems


@pytest.mark.parametrize(
    "type_name",
    [
        "os:system",
        "subprocess:run",
        "unikern.stages.tokenize:TokenizeStage",
        "builtins:eval",
        "__import__",
    ],
)
def test_a_pipeline_cannot_name_a_python_import_path(type_name: str) -> None:
    problems = problems_of(pipeline(extra=f"  evil:\n    type: '{type_name}'\n"))
    assert problems == [
        f"$.stages.evil.type: unknown stage type {type_name!r}; valid types: {VALID_TYPES}"
    ]


# ---- graph --------------------------------------------------------------------------


def test_a_pipeline_without_output_reports_step_output_unconsumed() -> None:
    problems = problems_of(pipeline(drop=("output",)))
    assert problems == [
        "$.stages: stage 'schedule' produces StepOutput, but no stage consumes it; stage types that do: output"
    ]


def test_a_missing_resource_provider_is_reported() -> None:
    problems = problems_of(pipeline(drop=("kv",)))
    assert problems == [
        "$.stages.schedule: requires resource 'kv', which no stage provides (provided: model, tokenizer)",
        "$.stages.execute: requires resource 'kv', which no stage provides (provided: model, tokenizer)",
    ]


def test_a_missing_tokenizer_reports_every_consequence() -> None:
    problems = problems_of(pipeline(drop=("tokenize",)))
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    assert "$.stages.schedule: consumes Tokenized, but no stage produces it" in joined
    assert (
        "the engine produces Submit, but no stage consumes it; stage types that do: tokenize"
        in joined
    )
    assert (
        "the engine produces Cancel, but no stage consumes it; stage types that do: tokenize"
        in joined
    )
    assert "$.stages.schedule: requires resource 'tokenizer'" in joined
    assert "$.stages.output: requires resource 'tokenizer'" in joined


def test_two_consumers_of_one_message_are_refused() -> None:
    problems = problems_of(pipeline(extra="  output2:\n    type: output\n"))
    joined = "\n".join(problems)
    assert "message StepOutput has several consumers: output, output2" in joined


# ---- model= and overrides -----------------------------------------------------------


def test_model_override_applies_only_to_stages_with_a_model_field() -> None:
    spec = parse_pipeline(pipeline(), model="/some/model/dir")
    with_model = {name for name, stage in spec.stages.items() if "model" in stage.params}
    assert with_model == {"tokenize", "execute"}
    assert spec.stages["tokenize"].params["model"] == "/some/model/dir"
    assert spec.stages["execute"].params["model"] == "/some/model/dir"
    for name in ("schedule", "kv", "output"):
        assert "model" not in spec.stages[name].params


def test_model_override_beats_the_file() -> None:
    text = pipeline(replace={"tokenize": "  tokenize:\n    type: tokenize\n    model: from/file\n"})
    assert parse_pipeline(text).stages["tokenize"].params["model"] == "from/file"
    assert parse_pipeline(text, model="/cli").stages["tokenize"].params["model"] == "/cli"


def test_load_pipeline_model_override(tmp_path: Path) -> None:
    spec = load_pipeline("generate", model=str(tmp_path))
    assert spec.stages["execute"].params["model"] == str(tmp_path)
    assert "model" not in spec.stages["kv"].params


def test_parse_overrides_values_are_yaml_scalars() -> None:
    assert parse_overrides(
        [
            "kv.memory_fraction=0.2",
            "kv.allocation=eager",
            "kv.kv_budget_bytes=67108864",
            "tokenize.max_prompt_tokens=null",
            "x.y=a=b",
        ]
    ) == {
        "kv": {"memory_fraction": 0.2, "allocation": "eager", "kv_budget_bytes": 67108864},
        "tokenize": {"max_prompt_tokens": None},
        "x": {"y": "a=b"},
    }
    assert parse_overrides([]) == {}


def test_parse_overrides_reports_every_malformed_assignment() -> None:
    with pytest.raises(PipelineErrors) as info:
        parse_overrides(["kv", "=1", "kv.=3", ".x=1", "kv.memory_fraction=0.2"])
    assert len(info.value.problems) == 4
    assert all("expected STAGE.KEY=VALUE" in p for p in info.value.problems)
    assert "--set 'kv':" in info.value.problems[0]


def test_overrides_are_applied_and_validated() -> None:
    spec = parse_pipeline(pipeline(), overrides=parse_overrides(["kv.memory_fraction=0.2"]))
    assert spec.stages["kv"].params["memory_fraction"] == 0.2
    problems = problems_of(
        pipeline(),
        overrides=parse_overrides(["kv.memory_fraction=abc", "kv.nosuch=1", "nosuch.x=1"]),
    )
    joined = "\n".join(problems)
    assert (
        "--set nosuch.*: no stage named 'nosuch'; stages: tokenize, schedule, kv, execute, output"
        in joined
    )
    assert "$.stages.kv.memory_fraction: Expected `float`, got `str`" in joined
    assert "$.stages.kv.nosuch: unknown field; valid fields: type, " in joined
    problems = problems_of(pipeline(), overrides=parse_overrides(["kv.memory_fraction=1.5"]))
    assert any(p.startswith("$.stages.kv.memory_fraction: must be in (0, 1]") for p in problems)


def test_set_reaches_the_server_section_over_the_file_or_without_one() -> None:
    """`--set server.KEY=VALUE` sets the `server:` section, typed as in the file: over the
    file's own values, and in a file that has no section."""
    with_section = pipeline(top="server: {max_waiting: 100, api_key: k}\n")
    spec = parse_pipeline(with_section, overrides=parse_overrides(["server.max_waiting=2"]))
    assert spec.server == {"max_waiting": 2, "api_key": "k"}
    spec = parse_pipeline(pipeline(), overrides=parse_overrides(["server.max_waiting=2", "server.host=0.0.0.0"]))
    assert spec.server == {"max_waiting": 2, "host": "0.0.0.0"}
    assert parse_pipeline(pipeline()).server == {}


def test_set_refuses_a_misspelled_or_mistyped_server_key_naming_the_valid_ones() -> None:
    problems = problems_of(pipeline(), overrides=parse_overrides(["server.max_waitin=2", "server.port=http"]))
    assert problems[0] == (
        "--set server.max_waitin: unknown field; valid fields: api_key, drain_seconds, host, "
        "max_body_bytes, max_waiting, port, retry_after_seconds, served_model_name"
    )
    assert problems[1].startswith("--set server.port: Expected `int`")
    assert len(problems) == 2


def test_set_names_server_among_the_sections_and_refuses_a_member_named_server() -> None:
    problems = problems_of(pipeline(), overrides=parse_overrides(["servr.max_waiting=2"]))
    assert problems == [
        "--set servr.*: no stage named 'servr'; stages: tokenize, schedule, kv, execute, output; "
        "or `server` for the server section"
    ]
    named_server = pipeline(extra="  server:\n    type: output\n", drop=("output",))
    problems = problems_of(named_server, overrides=parse_overrides(["server.max_waiting=2"]))
    assert problems == ["--set server.*: ambiguous: a member is named 'server' too; rename it"]


def test_the_kv_tiers_with_several_ranks_are_refused_when_the_pipeline_is_read() -> None:
    """A member's checks across members (`pipeline_problems`): the tiers of generate-offload
    with execute.tensor_parallel 2 are refused by name before any rank starts; one rank
    or the `generate` pipeline with two are fine."""
    with pytest.raises(PipelineErrors) as caught:
        load_pipeline("generate-offload", overrides=parse_overrides(["execute.tensor_parallel=2"]))
    tiers = [p for p in caught.value.problems if "the KV tiers do not run with several ranks yet" in p]
    assert sorted(p.split(":")[0] for p in tiers) == ["$.stages.disk", "$.stages.offload"]
    assert all("pipeline_parallel give 2" in p for p in tiers)
    load_pipeline("generate-offload")
    load_pipeline("generate", overrides=parse_overrides(["execute.pipeline_parallel=2"]))


# ---- files --------------------------------------------------------------------------


def test_load_pipeline_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(pipeline().replace("name: t\n", ""), encoding="utf-8")
    spec = load_pipeline(str(path))
    assert spec.name == "mine"  # defaults to the file's stem
    assert spec.source == str(path)


def test_a_missing_pipeline_file_or_name_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"unknown pipeline 'nope'.*generate"):
        load_pipeline("nope")


def test_problems_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(pipeline(extra="  x:\n    type: nosuch\n"), encoding="utf-8")
    with pytest.raises(PipelineErrors) as info:
        load_pipeline(str(path))
    assert str(info.value).startswith(f"{path}: 1 problem(s):")


# ---- services: members that lend a resource and consume no messages ------------------


def test_services_may_be_listed_in_their_own_section() -> None:
    text = pipeline(drop=("kv",), extra="services:\n" + STAGES["kv"])
    spec = parse_pipeline(text)
    assert spec.stages["kv"].kind == "service"
    assert spec.services == ["kv"]
    assert start_order(spec.stage_classes()).index("kv") < start_order(spec.stage_classes()).index("schedule")


def test_a_service_keeps_its_kind_when_listed_under_stages() -> None:
    spec = parse_pipeline(pipeline())
    assert {n for n, s in spec.stages.items() if s.kind == "service"} == {"kv"}


def test_a_stage_listed_as_a_service_is_refused() -> None:
    text = pipeline(drop=("output",), extra="services:\n" + STAGES["output"])
    problems = problems_of(text)
    assert "$.services.output.type: 'output' is a stage (it consumes messages); list it under `stages`" in problems


def test_a_member_name_in_both_sections_is_refused() -> None:
    text = pipeline(extra="services:\n" + STAGES["kv"])
    assert "$.services.kv: the name 'kv' is also a stage; member names are unique" in problems_of(text)


def test_the_server_section_is_kept_for_the_http_front_door() -> None:
    spec = parse_pipeline(pipeline(top="server: {port: 8123}\n"))
    assert spec.server == {"port": 8123}
    assert problems_of(pipeline(top="server: 3\n")) == ["$.server: expected a mapping of server settings, got int"]


def test_uses_is_checked_but_does_not_order_start_up() -> None:
    spec = parse_pipeline(pipeline())
    classes = spec.stage_classes()
    assert classes["execute"].uses == ("kv",)
    order = start_order(classes)
    assert order.index("execute") < order.index("kv")  # kv requires the model execute provides
    problems = problems_of(pipeline(drop=("kv", "schedule")))
    assert any("$.stages.execute: requires resource 'kv'" in p for p in problems)
