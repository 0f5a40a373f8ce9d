"""The weights read on a thread while the command line imports (unikern.platform.read_ahead)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from unikern.errors import ConfigError
from unikern.frontends.cli import early_model_dir
from unikern.platform import read_ahead


def test_the_load_takes_the_arrays_read_ahead_and_gets_the_same_model(tiny_llama):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    plain, _ = load_model(Path(tiny_llama))
    ahead = read_ahead.ReadAhead(Path(tiny_llama))
    read = ahead.arrays()
    assert ahead.error is None and ahead.seconds is not None and set(read) == set(ahead.files) and read
    with read_ahead.serving(ahead, Path(tiny_llama)) as figures:
        model, _ = load_model(Path(tiny_llama), lazy=True)
    assert figures["read_ahead_files"] == len(ahead.files) and figures["read_ahead_s"] >= 0
    by_id = {id(a) for arrays in read.values() for a in arrays.values()}
    params = dict(tree_flatten(model.parameters()))
    assert params and all(id(a) in by_id for a in params.values())  # the very arrays read, no second read
    for name, value in tree_flatten(plain.parameters()):
        assert mx.array_equal(params[name], value), name


def test_another_model_loads_from_its_files_and_mx_load_is_mlxs_again(tiny_llama, model_dir):
    own_load = mx.load
    other = Path(model_dir("llama-5m"))
    ahead = read_ahead.ReadAhead(Path(tiny_llama))
    with read_ahead.serving(ahead, other) as figures:
        assert mx.load is own_load
    assert figures == {}
    with read_ahead.serving(ahead, Path(tiny_llama)):
        assert mx.load is not own_load
        file = ahead.files[0]
        assert mx.load(file) is not None and mx.load(file, return_metadata=True)  # twice: the second is MLX's
    assert mx.load is own_load


def test_start_hands_over_one_read_once(tiny_llama, tmp_path):
    assert read_ahead.start(tmp_path) is None  # no config.json: nothing to read
    first = read_ahead.start(Path(tiny_llama))
    assert first is not None and read_ahead.start(Path(tiny_llama)) is None  # one at a time
    assert read_ahead.take() is first and read_ahead.take() is None
    first.arrays()


def test_the_setting_says_what_is_wrong():
    assert read_ahead.wanted({"UNIKERN_READ_AHEAD": "1"}) and not read_ahead.wanted({"UNIKERN_READ_AHEAD": "0"})
    with pytest.raises(ConfigError, match="UNIKERN_READ_AHEAD='yes'.*auto"):
        read_ahead.wanted({"UNIKERN_READ_AHEAD": "yes"})


def test_the_command_lines_model_is_found_before_the_pipeline_is_read():
    assert early_model_dir(["worker", "--model", "/m"]) == "/m"
    assert early_model_dir(["serve", "p.yaml", "--model=/m", "--port", "0"]) == "/m"
    assert early_model_dir(["run", "--set", "kv.block_size=64", "--set", "execute.model=/x", "--prompt", "hi"]) == "/x"
    assert early_model_dir(["run", "--set", "execute.model=/x", "--model", "/m"]) == "/m"  # --model wins, as it does
    assert early_model_dir(["validate", "--model", "/m"]) is None and early_model_dir(["worker"]) is None


def test_the_command_line_reads_ahead_and_answers_the_same(tiny_llama):
    def run(setting: str) -> tuple[str, str]:
        env = {**os.environ, "UNIKERN_READ_AHEAD": setting}
        done = subprocess.run([sys.executable, "-m", "unikern", "run", "--model", tiny_llama, "--prompt", "the cat",
                               "--max-tokens", "12", "--log-level", "info"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    text_on, log_on = run("1")
    text_off, log_off = run("0")
    assert text_on == text_off and text_on.strip()
    assert "read_ahead_files=1" in log_on and "read_ahead" not in log_off
