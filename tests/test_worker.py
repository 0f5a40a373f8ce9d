"""The NDJSON worker (DESIGN.md section 3, "Worker protocol"), driven as a subprocess.

One worker process serves the whole module (starting one costs seconds): the `session`
fixture sends every malformed line, then valid requests, waits for them, probes the
prefix cache and stats, and finally sends one more request and closes stdin at once (end
of input must drain it). Each test then checks one part of the transcript.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

KV_BUDGET = 64 << 20
WAIT_S = 180.0  # generous: the machine is small and shared

EVENT_KINDS = {"ready", "token", "done", "error", "stats"}


class WorkerProcess:
    """A worker subprocess: stdin lines out (numbered from 1), stdout lines collected."""

    def __init__(self, args: list[str], stderr_path: Path) -> None:
        self._stderr = open(stderr_path, "wb")  # closed in close()
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr
        )
        self.raw: list[bytes] = []
        self.events: list[dict[str, Any] | None] = []  # None where a line is not JSON
        self.lines_sent = 0
        self.eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            try:
                event = json.loads(raw)
            except ValueError:
                event = None
            with self._cond:
                self.raw.append(raw)
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    def send(self, line: bytes) -> int:
        """Write one line; return its 1-based line number."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        self.lines_sent += 1
        return self.lines_sent

    def send_json(self, obj: Any) -> int:
        return self.send(json.dumps(obj).encode())

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def wait_until(
        self, what: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = WAIT_S
    ) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                events = [e for e in self.events if isinstance(e, dict)]
                if predicate(events):
                    return
                if self.eof:
                    raise AssertionError(
                        f"worker closed stdout before {what}; stderr:\n{self.stderr_tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out waiting for {what}; stderr:\n{self.stderr_tail()}"
                    )
                self._cond.wait(min(left, 1.0))

    def wait_eof(self, timeout: float = WAIT_S) -> int:
        self._reader.join(timeout)
        assert not self._reader.is_alive(), f"stdout still open; stderr:\n{self.stderr_tail()}"
        return self.proc.wait(timeout)

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_bytes()[-4000:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
        self._stderr.close()


def terminal(events: list[dict[str, Any]], rid: str) -> bool:
    return any(e.get("id") == rid and e["event"] in ("done", "error") for e in events)


# ---- the script ---------------------------------------------------------------------

# label -> (line, id the error must carry, error code); sent in this order, after one
# blank line (which is counted but answered with nothing)
TOO_LONG = [5] * 3000  # the model's context is 2048
BAD_LINES: dict[str, tuple[bytes, str | None, str]] = {
    "not_json": (b"not json", None, "bad_request"),
    "truncated_json": (b'{"op": "generate", "id": "t1", "prompt": "x"', None, "bad_request"),
    "max_tokens_string": (
        b'{"op": "generate", "id": "e-mt-str", "prompt": "x", "max_tokens": "5"}',
        "e-mt-str",
        "bad_request",
    ),
    "prompt_number": (
        b'{"op": "generate", "id": "e-prompt-num", "prompt": 5}',
        "e-prompt-num",
        "bad_request",
    ),
    "temperature_negative": (
        b'{"op": "generate", "id": "e-temp", "prompt": "x", "temperature": -1}',
        "e-temp",
        "bad_request",
    ),
    "temperature_infinite": (
        b'{"op": "generate", "id": "e-temp-inf", "prompt": "x", "temperature": 1e400}',
        "e-temp-inf",
        "bad_request",
    ),
    "top_p_zero": (
        b'{"op": "generate", "id": "e-top-p-0", "prompt": "x", "top_p": 0}',
        "e-top-p-0",
        "bad_request",
    ),
    "top_p_two": (
        b'{"op": "generate", "id": "e-top-p-2", "prompt": "x", "top_p": 2}',
        "e-top-p-2",
        "bad_request",
    ),
    "unknown_field": (
        b'{"op": "generate", "id": "e-field", "prompt": "x", "bogus": 1}',
        "e-field",
        "bad_request",
    ),
    "unknown_op": (b'{"op": "frobnicate", "id": "e-op"}', "e-op", "bad_request"),
    "missing_op": (b'{"id": "e-no-op", "prompt": "x"}', "e-no-op", "bad_request"),
    "missing_id": (b'{"op": "generate", "prompt": "x"}', None, "bad_request"),
    "numeric_id": (b'{"op": "generate", "id": 5, "prompt": "x"}', None, "bad_request"),
    "empty_id": (b'{"op": "generate", "id": "", "prompt": "x"}', "", "bad_request"),
    "invalid_utf8": (
        b'{"op": "generate", "id": "e-utf8", "prompt": "\xff\xfe"}',
        None,
        "bad_request",
    ),
    "json_array": (b'[{"op": "stats"}]', None, "bad_request"),
    "json_number": (b"5", None, "bad_request"),
    "json_null": (b"null", None, "bad_request"),
    "json_string": (b'"generate"', None, "bad_request"),
    "deeply_nested": (b"[" * 100_000, None, "bad_request"),
    "token_outside_vocab": (
        b'{"op": "generate", "id": "e-vocab", "prompt_tokens": [1, 2, 5000]}',
        "e-vocab",
        "bad_request",
    ),
    "token_negative": (
        b'{"op": "generate", "id": "e-neg", "prompt_tokens": [1, -2]}',
        "e-neg",
        "bad_request",
    ),
    "token_huge": (
        b'{"op": "generate", "id": "e-tok-huge", "prompt_tokens": [1, 18446744073709551616]}',
        "e-tok-huge",
        "bad_request",
    ),
    "token_float": (
        b'{"op": "generate", "id": "e-tok-float", "prompt_tokens": [1.5]}',
        "e-tok-float",
        "bad_request",
    ),
    "prompt_tokens_empty": (
        b'{"op": "generate", "id": "e-empty-tokens", "prompt_tokens": []}',
        "e-empty-tokens",
        "bad_request",
    ),
    "prompt_too_long": (
        json.dumps({"op": "generate", "id": "e-long", "prompt_tokens": TOO_LONG}).encode(),
        "e-long",
        "prompt_too_long",
    ),
    "max_tokens_huge": (
        b'{"op": "generate", "id": "e-mt-huge", "prompt": "x", "max_tokens": 1e30}',
        "e-mt-huge",
        "bad_request",
    ),
    "max_tokens_zero": (
        b'{"op": "generate", "id": "e-mt-0", "prompt": "x", "max_tokens": 0}',
        "e-mt-0",
        "bad_request",
    ),
    "max_tokens_negative": (
        b'{"op": "generate", "id": "e-mt-neg", "prompt": "x", "max_tokens": -3}',
        "e-mt-neg",
        "bad_request",
    ),
    "seed_huge": (
        b'{"op": "generate", "id": "e-seed", "prompt": "x", "seed": 1180591620717411303424}',
        "e-seed",
        "bad_request",
    ),
    "seed_negative": (
        b'{"op": "generate", "id": "e-seed-neg", "prompt": "x", "seed": -1}',
        "e-seed-neg",
        "bad_request",
    ),
    "two_prompts": (
        b'{"op": "generate", "id": "e-two", "prompt": "x", "prompt_tokens": [1]}',
        "e-two",
        "bad_request",
    ),
    "no_prompt": (b'{"op": "generate", "id": "e-none", "max_tokens": 3}', "e-none", "bad_request"),
    "messages_empty": (
        b'{"op": "generate", "id": "e-msg-empty", "messages": []}',
        "e-msg-empty",
        "bad_request",
    ),
    "messages_no_content": (
        b'{"op": "generate", "id": "e-msg-bad", "messages": [{"role": "user"}]}',
        "e-msg-bad",
        "bad_request",
    ),
    "messages_string": (
        b'{"op": "generate", "id": "e-msg-str", "messages": "hi"}',
        "e-msg-str",
        "bad_request",
    ),
    "stop_empty": (
        b'{"op": "generate", "id": "e-stop", "prompt": "x", "stop": ""}',
        "e-stop",
        "bad_request",
    ),
    "cancel_without_id": (b'{"op": "cancel"}', None, "bad_request"),
    "stats_unknown_field": (b'{"op": "stats", "verbose": true}', None, "bad_request"),
    "cancel_unknown_id": (b'{"op": "cancel", "id": "nosuch"}', "nosuch", "unknown_id"),
}

PROMPT_TOKENS = [17, 250, 9, 311, 42, 77, 500, 12, 600, 33]
GREEDY_TOKENS = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
CACHE_PROMPT = [(i * 7) % 1000 + 10 for i in range(300)]  # > one 256-token block

VALID: dict[str, dict[str, Any]] = {
    "v-prompt": {"prompt": "def add(a, b):", "max_tokens": 6},
    "v-tokens": {"prompt_tokens": PROMPT_TOKENS, "max_tokens": 5},
    "v-messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "g1": {"prompt_tokens": GREEDY_TOKENS, "max_tokens": 8, "temperature": 0.0},
    "g2": {"prompt_tokens": GREEDY_TOKENS, "max_tokens": 8},
    "s1": {"prompt_tokens": GREEDY_TOKENS, "max_tokens": 8, "temperature": 1.0, "seed": 7},
    "s2": {"prompt_tokens": GREEDY_TOKENS, "max_tokens": 8, "temperature": 1.0, "seed": 7},
    "s3": {"prompt_tokens": GREEDY_TOKENS, "max_tokens": 8, "temperature": 1.0, "seed": 8},
}


@dataclass
class Transcript:
    model_dir: Path
    config: dict[str, Any]
    raw: list[bytes]
    events: list[dict[str, Any]]
    lines: dict[str, int] = field(default_factory=dict)  # label -> stdin line number
    blank_line: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # after every request finished
    stats_busy: dict[str, Any] = field(default_factory=dict)  # while a request ran
    returncode: int | None = None
    stderr: str = ""

    def of(self, rid: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e.get("id") == rid and e["event"] in ("token", "done", "error")
        ]

    def at_line(self, line: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("line") == line]

    def done(self, rid: str) -> dict[str, Any]:
        found = [e for e in self.of(rid) if e["event"] == "done"]
        assert len(found) == 1, f"{rid}: {self.of(rid)}"
        return found[0]

    def token_ids(self, rid: str) -> list[int]:
        return [e["token_id"] for e in self.of(rid) if e["event"] == "token"]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Transcript:
    from unikern.testing.modelgen import cached_model

    model_dir = Path(cached_model("tiny-llama"))
    config = json.loads((model_dir / "config.json").read_text())
    stderr_path = tmp_path_factory.mktemp("worker") / "stderr.txt"
    args = [
        sys.executable,
        "-m",
        "unikern",
        "worker",
        "--model",
        str(model_dir),
        "--set",
        f"kv.kv_budget_bytes={KV_BUDGET}",
    ]
    w = WorkerProcess(args, stderr_path)
    t = Transcript(model_dir, config, w.raw, [])
    try:
        w.wait_until("ready", lambda ev: len(ev) >= 1)

        # 1. every malformed line, with a blank line first (counted, not answered)
        t.blank_line = w.send(b"")
        for label, (line, _, _) in BAD_LINES.items():
            t.lines[label] = w.send(line)
        # an empty prompt string (should be refused like an empty prompt_tokens list)
        t.lines["empty_prompt"] = w.send_json(
            {"op": "generate", "id": "e-empty-prompt", "prompt": "", "max_tokens": 3}
        )

        # 2. a long request, the same id again while it runs, then cancel it
        t.lines["long"] = w.send_json(
            {"op": "generate", "id": "long", "prompt": "x", "max_tokens": 1500}
        )
        t.lines["duplicate"] = w.send_json(
            {"op": "generate", "id": "long", "prompt": "y", "max_tokens": 1500}
        )
        t.lines["stats_busy"] = w.send_json({"op": "stats"})
        t.lines["cancel"] = w.send_json({"op": "cancel", "id": "long"})

        # 3. valid requests, after all of the above
        for rid, body in VALID.items():
            t.lines[rid] = w.send_json({"op": "generate", "id": rid, **body})
        waiting_for = [
            *VALID,
            "e-empty-prompt",
            "e-vocab",
            "e-long",
            "e-empty-tokens",
            "e-msg-empty",
        ]
        w.wait_until("the valid requests", lambda ev: all(terminal(ev, rid) for rid in waiting_for))

        # 4. the prefix cache: the same 300-token prompt twice, one after the other
        for rid in ("c1", "c2"):
            t.lines[rid] = w.send_json(
                {"op": "generate", "id": rid, "prompt_tokens": CACHE_PROMPT, "max_tokens": 2}
            )
            w.wait_until(rid, lambda ev, rid=rid: terminal(ev, rid))

        # 5. stats once nothing runs
        t.lines["stats"] = w.send_json({"op": "stats"})
        w.wait_until("stats", lambda ev: sum(e["event"] == "stats" for e in ev) >= 2)

        # 6. one more request, and end of input right away: it must still finish
        t.lines["drain"] = w.send_json(
            {"op": "generate", "id": "drain", "prompt_tokens": PROMPT_TOKENS, "max_tokens": 20}
        )
        w.close_stdin()
        t.returncode = w.wait_eof()
    finally:
        w.close()
        t.stderr = stderr_path.read_text(errors="replace")
    t.events = [e for e in w.events if isinstance(e, dict)]
    stats = [e for e in t.events if e["event"] == "stats"]
    t.stats_busy, t.stats = stats[0], stats[-1]
    return t


# ---- stdout is the protocol ---------------------------------------------------------


def test_ready_comes_first(session: Transcript) -> None:
    first = json.loads(session.raw[0])
    assert set(first) == {"event", "model", "pipeline"}
    assert first["event"] == "ready"
    assert first["pipeline"] == "generate"
    assert isinstance(first["model"], str) and session.model_dir.name in first["model"]
    assert sum(e["event"] == "ready" for e in session.events) == 1


def test_stdout_holds_only_json_event_lines(session: Transcript) -> None:
    assert len(session.raw) > 50
    for raw in session.raw:
        assert raw.endswith(b"\n")
        event = json.loads(raw)  # every line parses
        assert isinstance(event, dict), raw
        assert event.get("event") in EVENT_KINDS, raw
    assert len(session.events) == len(session.raw)


def test_end_of_stdin_drains_requests_in_flight_and_exits_0(session: Transcript) -> None:
    assert session.returncode == 0, session.stderr[-3000:]
    done = session.done("drain")
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 20
    assert len(session.token_ids("drain")) == 20
    assert json.loads(session.raw[-1]) == done  # nothing after it


# ---- malformed lines ----------------------------------------------------------------


@pytest.mark.parametrize(
    "label",
    list(BAD_LINES),
)
def test_a_bad_line_gets_exactly_one_error(session: Transcript, label: str) -> None:
    _, expected_id, code = BAD_LINES[label]
    line = session.lines[label]
    answers = session.at_line(line)
    assert len(answers) == 1, answers
    [error] = answers
    assert set(error) == {"event", "id", "code", "message", "line"}
    assert error["event"] == "error"
    assert error["line"] == line
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"].strip()
    assert error["id"] == expected_id
    if expected_id:  # nothing else ever happens under that id
        assert session.of(expected_id) == [error]


def test_error_messages_say_what_is_wrong(session: Transcript) -> None:
    def message(label: str) -> str:
        return session.at_line(session.lines[label])[0]["message"]

    assert "JSON" in message("not_json")
    assert "UTF-8" in message("invalid_utf8")
    assert "max_tokens" in message("max_tokens_string")
    assert "$.prompt" in message("prompt_number")
    assert "temperature" in message("temperature_negative")
    assert "top_p" in message("top_p_zero") and "top_p" in message("top_p_two")
    assert "bogus" in message("unknown_field")
    assert "frobnicate" in message("unknown_op") and "generate, cancel, stats" in message(
        "unknown_op"
    )
    assert "generate, cancel, stats" in message("missing_op")
    assert "`id`" in message("missing_id")
    assert "5000" in message("token_outside_vocab") and "1024" in message("token_outside_vocab")
    assert "prompt_tokens" in message("token_negative")
    assert "3000" in message("prompt_too_long")
    assert "seed" in message("seed_huge")
    assert "max_tokens" in message("max_tokens_huge")
    assert "nosuch" in message("cancel_unknown_id")
    assert "empty" in message("prompt_tokens_empty")


def test_blank_lines_are_counted_but_not_answered(session: Transcript) -> None:
    assert session.blank_line == 1
    assert session.lines["not_json"] == 2  # line numbers count the blank line
    assert session.at_line(1) == []


def test_every_error_is_accounted_for(session: Transcript) -> None:
    errors = [e for e in session.events if e["event"] == "error"]
    expected_lines = {session.lines[label] for label in BAD_LINES} | {session.lines["duplicate"]}
    got = sorted(e["line"] for e in errors if e["line"] != session.lines["empty_prompt"])
    assert got == sorted(expected_lines)  # one each, none missing, none extra


def test_an_empty_prompt_string_is_refused(session: Transcript) -> None:
    answers = session.at_line(session.lines["empty_prompt"])
    assert len(answers) == 1 and answers[0]["event"] == "error"
    assert answers[0]["id"] == "e-empty-prompt"
    assert session.of("e-empty-prompt") == answers


# ---- duplicate ids and cancel -------------------------------------------------------


def test_a_duplicate_id_in_flight_is_rejected(session: Transcript) -> None:
    answers = session.at_line(session.lines["duplicate"])
    assert len(answers) == 1
    [error] = answers
    assert error["event"] == "error"
    assert error["code"] == "duplicate_id"
    assert error["id"] == "long"
    assert "long" in error["message"]
    # the first request was not disturbed by it: no error under its own line
    assert session.at_line(session.lines["long"]) == []


def test_cancel_stops_the_request_in_flight(session: Transcript) -> None:
    # whatever the done event, the request stopped long before max_tokens, and the
    # cancel itself was accepted (no unknown_id error)
    assert session.at_line(session.lines["cancel"]) == []
    assert len(session.token_ids("long")) < 1500


def test_cancel_ends_the_request_with_done_cancelled(session: Transcript) -> None:
    events = session.of("long")
    dones = [e for e in events if e["event"] == "done"]
    assert len(dones) == 1
    assert dones[0]["finish_reason"] == "cancelled"
    assert dones[0]["usage"]["completion_tokens"] == len(session.token_ids("long")) < 1500
    assert events[-1] == dones[0]


# ---- valid requests -----------------------------------------------------------------


@pytest.mark.parametrize("rid", list(VALID))
def test_a_valid_request_streams_tokens_then_one_done(session: Transcript, rid: str) -> None:
    events = session.of(rid)
    assert events, f"no events for {rid}"
    *tokens, done = events
    assert done["event"] == "done"
    assert [e["event"] for e in tokens] == ["token"] * len(tokens)
    vocab = session.config["vocab_size"]
    for e in tokens:
        assert set(e) == {"event", "id", "token_id", "text"}
        assert isinstance(e["token_id"], int) and 0 <= e["token_id"] < vocab
        assert isinstance(e["text"], str)
    assert set(done) == {"event", "id", "finish_reason", "usage"}
    assert set(done["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    # max_tokens is honoured exactly (these prompts do not reach EOS)
    max_tokens = VALID[rid]["max_tokens"]
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == len(tokens) == max_tokens
    assert done["usage"]["cached_tokens"] == 0
    if "prompt_tokens" in VALID[rid]:
        assert done["usage"]["prompt_tokens"] == len(VALID[rid]["prompt_tokens"])
    else:
        assert done["usage"]["prompt_tokens"] > 0


def test_text_prompt_and_chat_messages_count_their_prompt_tokens(session: Transcript) -> None:
    # "def add(a, b):" is several tokens; the chat template wraps "hi" in more than one
    assert session.done("v-prompt")["usage"]["prompt_tokens"] >= 3
    assert session.done("v-messages")["usage"]["prompt_tokens"] >= 3
    assert "".join(e["text"] for e in session.of("v-prompt") if e["event"] == "token")


def test_greedy_is_deterministic(session: Transcript) -> None:
    assert len(session.token_ids("g1")) == 8
    assert session.token_ids("g1") == session.token_ids("g2")


def test_a_seed_makes_sampling_reproducible(session: Transcript) -> None:
    assert len(session.token_ids("s1")) == 8
    assert session.token_ids("s1") == session.token_ids("s2")
    assert session.token_ids("s1") != session.token_ids("s3")


def test_a_repeated_prompt_is_served_from_the_prefix_cache(session: Transcript) -> None:
    first, second = session.done("c1"), session.done("c2")
    assert first["usage"] == {"prompt_tokens": 300, "completion_tokens": 2, "cached_tokens": 0}
    block, unit = session.stats["kv"]["block_size"], session.stats["kv"]["kernel_block_size"]
    # the whole blocks, then the written whole kernel blocks of the one the first request
    # ended in (a partial hit), short of the last token, which is always computed
    whole = (300 // block) * block
    assert second["usage"] == {
        "prompt_tokens": 300,
        "completion_tokens": 2,
        "cached_tokens": whole + (299 - whole) // unit * unit,
    }
    assert session.token_ids("c1") == session.token_ids("c2")


# ---- stats --------------------------------------------------------------------------


def bytes_per_block(config: dict[str, Any], block_size: int) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[
        config.get("dtype") or config.get("torch_dtype") or "float32"
    ]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * block_size * kv_heads * head_dim * itemsize


def test_stats_reports_memory_and_kv(session: Transcript) -> None:
    stats = session.stats
    assert stats["event"] == "stats"
    memory, kv = stats["memory"], stats["kv"]
    assert isinstance(memory["rss_bytes"], int) and memory["rss_bytes"] > 10 << 20
    assert memory["kv_budget_bytes"] == KV_BUDGET
    assert (
        isinstance(memory["kv_resident_bytes"], int)
        and 0 <= memory["kv_resident_bytes"] <= KV_BUDGET
    )
    assert kv["block_size"] == 256  # the built-in pipeline's values
    assert kv["kernel_block_size"] == 16
    assert kv["blocks_total"] == KV_BUDGET // bytes_per_block(session.config, 256)
    assert isinstance(kv["blocks_cached"], int) and kv["blocks_cached"] >= 1  # c1's full block


def test_stats_while_busy_counts_used_blocks(session: Transcript) -> None:
    busy = session.stats_busy
    assert busy["event"] == "stats"
    assert session.lines["stats_busy"] < session.lines["cancel"]
    assert busy["kv"]["blocks_total"] == session.stats["kv"]["blocks_total"]
    assert 0 <= busy["kv"]["blocks_used"] <= busy["kv"]["blocks_total"]


def test_no_blocks_are_used_once_every_request_finished(session: Transcript) -> None:
    assert session.stats["kv"]["blocks_used"] == 0


def test_stats_tiers_device(session: Transcript) -> None:
    device = session.stats["tiers"]["device"]
    for key in ("blocks", "bytes", "hits", "misses", "evictions"):
        assert isinstance(device[key], int) and device[key] >= 0, key
    assert device["hits"] >= 1  # c2 reused c1's block


def test_stats_platform_section(session: Transcript) -> None:
    platform = session.stats["platform"]
    assert platform["backend"] in ("metal", "cuda", "cpu")
    assert isinstance(platform["unified_memory"], bool)
    assert isinstance(platform["total_memory"], int) and platform["total_memory"] > 0
    assert platform["device_count"] == 1
    assert isinstance(platform["pin_memory"], bool)
    assert isinstance(platform["blas"], str) and platform["blas"]
    assert isinstance(session.stats["memory"]["wired_bytes"], int)
