"""The command line (DESIGN.md section 3, "Command line"), run as real subprocesses.

The `unikern run` invocations that load a model start together in one module fixture
(each costs seconds of imports), then the tests check their results one by one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_CONFIG = ROOT / "kernel" / "assets" / "default_model" / "config.json"
PROMPT = "def add(a, b):"
TIMEOUT_S = 240


def unikern_cmd() -> list[str]:
    """The `unikern` console script next to this Python (the documented entry point)."""
    script = Path(sys.executable).with_name("unikern")
    if script.exists():
        return [str(script)]
    found = shutil.which("unikern")
    return [found] if found else [sys.executable, "-m", "unikern"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*unikern_cmd(), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=TIMEOUT_S,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from unikern.testing.modelgen import cached_model

    return Path(cached_model("tiny-llama"))


@pytest.fixture(scope="module")
def runs(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every model-loading `unikern run`, started at once and waited for together."""
    empty = tmp_path_factory.mktemp("not_a_model")
    invocations = {
        "greedy": [
            "run",
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--set",
            "kv.memory_fraction=0.2",
            "--set",
            "server.max_waiting=2",
        ],
        "sampled": [
            "run",
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "6",
            "--temperature",
            "0.8",
            "--seed",
            "3",
            "--top-p",
            "0.9",
        ],
        "missing_model": ["run", "--model", str(empty), "--prompt", PROMPT, "--max-tokens", "2"],
        "default_model": ["run", "--prompt", PROMPT, "--max-tokens", "8"],
    }
    procs = {
        name: subprocess.Popen(
            [*unikern_cmd(), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in invocations.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


# ---- run ----------------------------------------------------------------------------


def test_run_streams_a_completion_to_stdout(runs) -> None:
    result = runs["greedy"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "no completion text on stdout"
    assert result.stdout.endswith("\n")
    assert "Traceback" not in result.stderr


def test_run_accepts_a_stage_override(runs) -> None:
    # `--set kv.memory_fraction=0.2` and `--set server.max_waiting=2` were given to the
    # greedy run: accepted, not refused (a pipeline file's every section can be set)
    result = runs["greedy"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "problem" not in result.stderr


def test_run_takes_a_named_pipeline_and_sampling_options(runs) -> None:
    result = runs["sampled"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr


def test_run_without_model_uses_the_embedded_default(runs) -> None:
    # committed with the package: its absence is a regression, never a skip
    assert DEFAULT_MODEL_CONFIG.is_file(), f"the embedded default model is missing ({DEFAULT_MODEL_CONFIG})"
    result = runs["default_model"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_a_bad_model_directory_is_a_clear_error(runs) -> None:
    result = runs["missing_model"]
    assert result.returncode != 0
    assert "config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_requires_a_prompt() -> None:
    result = run_cli("run", "--max-tokens", "2")
    assert result.returncode == 2  # argparse usage error
    assert "--prompt" in result.stderr


# ---- validate -----------------------------------------------------------------------


def test_validate_a_builtin_pipeline_prints_ok(tmp_path: Path) -> None:
    # from any directory: built-in pipelines ship as package data
    result = run_cli("validate", "generate", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "ok\n"
    assert os.listdir(tmp_path) == []  # and it writes nothing there


def test_validate_a_good_file_prints_ok(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    shutil.copy(ROOT / "pipelines" / "generate.yaml", path)
    result = run_cli("validate", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "ok\n"


BAD_YAML = """\
name: bad
stages:
  tokenize:
    type: tokenize
  schedule:
    type: schedule
    max_num_seqs: many
  kv:
    type: kv_manager
    block_sise: 256
  execute:
    type: mlx_execute
  output:
    type: outptu
"""

BLOCK_YAML = """\
name: blocks
stages:
  tokenize:
    type: tokenize
  schedule:
    type: schedule
  kv:
    type: kv_manager
    block_size: 100
    kernel_block_size: 16
  execute:
    type: mlx_execute
  output:
    type: output
"""


def problem_lines(stdout: str) -> list[str]:
    return [line.removeprefix("  - ") for line in stdout.splitlines() if line.startswith("  - ")]


def test_validate_prints_every_problem_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_YAML)
    result = run_cli("validate", str(path))
    assert result.returncode == 1
    assert "ok" not in result.stdout.split()
    problems = problem_lines(result.stdout)
    assert f"{path}: {len(problems)} problem(s):" in result.stdout  # all of them printed
    # wrong type: the path and what the field takes
    assert "$.stages.schedule.max_num_seqs: Expected `int`, got `str` (got 'many')" in problems
    # unknown field: the path and the valid fields
    [unknown_field] = [p for p in problems if p.startswith("$.stages.kv.block_sise:")]
    assert "unknown field; valid fields: type, " in unknown_field
    for name in (
        "block_size",
        "kernel_block_size",
        "memory_fraction",
        "kv_budget_bytes",
        "allocation",
    ):
        assert name in unknown_field
    # unknown stage type: the path and the valid types
    assert (
        "$.stages.output.type: unknown stage type 'outptu'; "
        "valid types: disk_tier, kv_manager, mlx_execute, offload_mover, output, schedule, "
        "schedule_tiered, tokenize"
    ) in problems
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_reports_block_size_not_a_multiple_of_kernel_block_size(tmp_path: Path) -> None:
    path = tmp_path / "blocks.yaml"
    path.write_text(BLOCK_YAML)
    result = run_cli("validate", str(path))
    assert result.returncode == 1
    problems = problem_lines(result.stdout)
    assert any(
        p.startswith("$.stages.kv.block_size: 100 is not a whole multiple of kernel_block_size 16")
        for p in problems
    ), result.stdout


def test_validate_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = run_cli("validate", str(missing))
    assert result.returncode == 1
    assert f"pipeline file '{missing}' does not exist" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    result = run_cli("validate", "nope")
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert "unknown pipeline 'nope'" in out and "generate" in out  # names the built-in ones
    assert "Traceback" not in out


def test_run_with_a_missing_pipeline_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = run_cli("run", str(missing), "--prompt", "x")
    assert result.returncode == 2
    assert f"pipeline file '{missing}' does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# ---- --set --------------------------------------------------------------------------


def test_set_refuses_an_unknown_stage_naming_it(model_dir: Path) -> None:
    result = run_cli("worker", "--model", str(model_dir), "--set", "nosuch.x=1")
    assert result.returncode == 2
    assert "no stage named 'nosuch'" in result.stderr
    assert "stages: tokenize, schedule, kv, execute, output" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # no ready event: the worker never started


def test_set_refuses_an_unknown_field_and_a_malformed_assignment(model_dir: Path) -> None:
    result = run_cli("worker", "--model", str(model_dir), "--set", "kv.nosuch=1")
    assert result.returncode == 2
    assert "$.stages.kv.nosuch: unknown field; valid fields: type, " in result.stderr
    result = run_cli("worker", "--model", str(model_dir), "--set", "kv.memory_fraction")
    assert result.returncode == 2
    assert "expected STAGE.KEY=VALUE" in result.stderr
    assert result.stdout == ""


def test_set_reaches_the_settings_serve_uses(tmp_path: Path) -> None:
    """`serve --set server.KEY=VALUE`: over the file's `server:` section, or without one,
    in the ServerParams `serve` hands its HTTP server; flags still win over both."""
    from unikern.frontends.cli import build_parser, serve_settings

    text = (ROOT / "pipelines" / "generate.yaml").read_text() + "server: {max_waiting: 100, api_key: from-the-file}\n"
    (tmp_path / "served.yaml").write_text(text)
    args = build_parser().parse_args(["serve", str(tmp_path / "served.yaml"), "--set", "server.max_waiting=2"])
    _, params = serve_settings(args)
    assert (params.max_waiting, params.api_key) == (2, "from-the-file")
    args = build_parser().parse_args(
        ["serve", "--set", "server.max_waiting=2", "--set", "server.port=9001", "--port", "9002"]
    )
    _, params = serve_settings(args)
    assert (params.max_waiting, params.port, params.api_key) == (2, 9002, None)


def test_set_refuses_a_misspelled_server_key_naming_the_valid_ones() -> None:
    result = run_cli("serve", "--set", "server.max_waitin=2")
    assert result.returncode == 2
    assert "--set server.max_waitin: unknown field; valid fields: api_key, drain_seconds, host, " in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stderr
