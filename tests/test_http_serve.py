"""`unikern serve` as a real process: settings from the pipeline file's `server:` section
and from flags, readiness, and SIGTERM/SIGINT (stop accepting, drain, then cancel, exit 0)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.test_cli import unikern_cmd
from unikern.errors import ConfigError
from unikern.frontends.http.params import ServerParams, server_params
from unikern.spec import parse_pipeline

PIPELINE = """
name: served
stages:
  tokenize: {type: tokenize}
  schedule: {type: schedule}
  kv: {type: kv_manager, kv_budget_bytes: 67108864}
  execute: {type: mlx_execute}
  output: {type: output}
server: {port: 0, api_key: from-the-file, drain_seconds: 120}
"""
PROMPT = "def add(a, b):"  # greedy tiny-llama does not reach EOS within 1500 tokens from it
MAX_TOKENS = 600


class Served:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                [*unikern_cmd(), "serve", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
            )
        self.url = ""

    def wait_ready(self) -> None:
        while not (found := re.search(r"listening on (http://\S+)", self.log.read_text())):
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.05)
        self.url = found.group(1)
        while "ready: model" not in self.log.read_text():
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both server processes, started at once (each spends seconds importing)."""
    from unikern.testing.modelgen import cached_model

    model = str(cached_model("tiny-llama"))
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "served.yaml").write_text(PIPELINE)
    started = {
        "file": Served([str(tmp / "served.yaml"), "--model", model], tmp / "file.log"),
        "flags": Served(
            ["--model", model, "--set", "kv.kv_budget_bytes=67108864", "--port", "0", "--api-key", "from-a-flag",
             "--drain-seconds", "0"], tmp / "flags.log",
        ),
    }
    try:
        for served in started.values():
            served.wait_ready()
        yield started
    finally:
        for served in started.values():
            if served.process.poll() is None:
                served.process.kill()
                served.process.wait()


def stream_then_signal(served: Served, key: str, signum: int) -> tuple[list[dict], int]:
    """Start a long greedy stream, signal the server after its first chunk, read to the end."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"x-api-key": key}, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        served.process.send_signal(signum)
        chunks = [json.loads(first[5:])] + [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    return chunks, served.process.wait(timeout=200)


def test_settings_come_from_the_server_section(servers) -> None:
    served = servers["file"]
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    models = httpx.get(f"{served.url}/v1/models", headers={"Authorization": "Bearer from-the-file"}).json()
    assert [m["id"] for m in models["data"]] == [served.process.args[4]]  # the --model value as given


def test_sigterm_drains_requests_in_flight_then_exits_0(servers) -> None:
    chunks, code = stream_then_signal(servers["file"], "from-the-file", signal.SIGTERM)
    assert code == 0
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # drained: the request ran to its end
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_sigint_past_the_drain_time_cancels_then_exits_0(servers) -> None:
    served = servers["flags"]
    assert httpx.get(f"{served.url}/v1/models", headers={"x-api-key": "from-the-file"}).status_code == 401
    chunks, code = stream_then_signal(served, "from-a-flag", signal.SIGINT)
    assert code == 0
    assert chunks[-1]["usage"]["completion_tokens"] < MAX_TOKENS  # cancelled: it ended early
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health")


def test_the_server_section_is_checked_with_its_paths() -> None:
    text = PIPELINE.replace("server: {port: 0, api_key: from-the-file, drain_seconds: 120}",
                            "server: {port: http, max_waiting: 0, colour: blue}")
    with pytest.raises(ConfigError) as caught:
        parse_pipeline(text)
    problems = "\n".join(caught.value.problems)
    for path in ("$.server.port: Expected `int`", "$.server.max_waiting: Expected `int` >= 1", "$.server.colour: unknown field"):
        assert path in problems


def test_flags_override_the_file() -> None:
    params = server_params(parse_pipeline(PIPELINE).server)
    assert (params.port, params.api_key, params.drain_seconds) == (0, "from-the-file", 120.0)
    flags = params.with_overrides(host=None, port=9000, api_key=None, drain_seconds=1.5)
    assert flags == ServerParams(port=9000, api_key="from-the-file", drain_seconds=1.5)
