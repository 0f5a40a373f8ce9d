"""docs/configuration.md is generated from the parameter Structs (tools/docs/gen_configuration.py):
it must be what the generator writes now, and every field of every built-in stage's Params
and of ServerParams must carry a docstring, so a field added without a description fails."""

from __future__ import annotations

import difflib

import msgspec

from tools.docs import gen_configuration as gen
from unikern.stage import StageParams
from unikern.stages.execute.stage import MLXExecuteParams


def test_every_parameter_has_a_docstring() -> None:
    missing = gen.missing_docs()
    assert not missing, f"fields without a docstring (add one right under each): {', '.join(missing)}"


def test_the_doc_is_what_the_generator_writes() -> None:
    expected = gen.render()
    found = gen.DOC.read_text(encoding="utf-8") if gen.DOC.is_file() else ""
    diff = "".join(difflib.unified_diff(found.splitlines(True), expected.splitlines(True), "docs", "generator", n=1))
    assert found == expected, f"docs/configuration.md is stale: run `{gen.COMMAND}`\n{diff[:3000]}"
    assert gen.main(["--check"]) == 0


class _Base(StageParams, frozen=True):
    documented: int = 1
    """Read from the base class's source."""


class _Child(_Base, frozen=True):
    undocumented: str = "x"
    also: bool | None = None
    """Documented in the subclass."""


def test_docstrings_are_read_through_the_mro_and_a_missing_one_shows() -> None:
    docs = gen.field_docs(_Child)
    assert docs == {"documented": "Read from the base class's source.", "also": "Documented in the subclass."}
    assert [f.name for f in msgspec.structs.fields(_Child) if f.name not in docs] == ["undocumented"]


def test_types_and_defaults_read_as_written_in_yaml() -> None:
    fields = {f.name: f for f in msgspec.structs.fields(MLXExecuteParams)}
    assert gen.render_type(fields["dequantize_rows"].type) == 'int | "auto" | "never"'
    assert gen.render_type(fields["gil_switch_ms"].type) == 'float | "auto" | null'
    assert gen.render_default(fields["gil_switch_ms"]) == '"auto"'
    assert gen.render_default(fields["hostfile"]) == "null"
    server = {f.name: f for f in msgspec.structs.fields(gen.ServerParams)}
    assert gen.render_type(server["port"].type) == "int (>= 0, <= 65535)"
    assert gen.render_default(server["max_body_bytes"]) == "4194304 (4 MiB)"
