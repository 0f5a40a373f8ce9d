"""Structured output with llguidance: response formats compiled once per (format,
tokenizer) in the tokenize stage; on the model thread one bitmask per step for all
constrained rows, applied on the device, and each request's matcher advanced."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from unikern.errors import RequestError
from unikern.platform.bridge import Bridge

# compiled formats kept per tokenizer (a compiled matcher is a few KiB to a few MiB)
MAX_CACHED_FORMATS = 256


def _json_options(strict: bool) -> dict[str, Any]:
    # no free whitespace between tokens: small models can loop on it forever (a schema's
    # own "x-guidance" options still win); non-strict requests skip unknown keywords
    return {"whitespace_flexible": False, "lenient": not strict}


class GrammarCompiler:
    """Response formats -> llguidance matchers for one tokenizer. `compile` may run on any
    thread (the tokenize stage calls it off the event loop); each request gets its own
    copy of the compiled matcher (a deep copy costs about a microsecond)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._tokenizer = None  # built at the first constrained request (~10 ms to 1 s)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # formats compiled (cache misses), for tests and stats

    @staticmethod
    def key(fmt: Mapping[str, Any]) -> str:
        return json.dumps(fmt, sort_keys=True, separators=(",", ":"), default=str)

    def matcher(self, fmt: Mapping[str, Any]) -> Any | None:
        """A fresh matcher if `fmt` is compiled already, else None (call `compile`)."""
        with self._lock:
            template = self._cache.get(self.key(fmt))
            if template is not None:
                self._cache.move_to_end(self.key(fmt))
        return None if template is None else template.deep_copy()

    def compile(self, fmt: Mapping[str, Any]) -> Any:
        """A fresh matcher for `fmt`, compiling and caching it; RequestError (bad_request)
        says what is wrong with a schema, regex or grammar."""
        import llguidance

        found = self.matcher(fmt)
        if found is not None:
            return found
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
        grammar = self._grammar(fmt)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            raise RequestError(f"response_format ({fmt['type']}): {problem.strip()}")
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise RequestError(f"response_format ({fmt['type']}): {template.get_error().strip()}")
        with self._lock:
            self._cache[self.key(fmt)] = template
            self.compiled += 1
            while len(self._cache) > MAX_CACHED_FORMATS:
                self._cache.popitem(last=False)
        return template.deep_copy()

    @staticmethod
    def _grammar(fmt: Mapping[str, Any]) -> str:
        import llguidance

        kind = fmt["type"]
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=_json_options(strict=False)
                )
            if kind == "json_schema":
                spec = fmt["json_schema"]
                schema = spec.get("schema", {})
                if not isinstance(schema, Mapping):
                    raise RequestError("response_format.json_schema.schema must be a JSON object")
                options = _json_options(strict=bool(spec.get("strict", False)))
                return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=options)
            if kind == "regex":
                if not isinstance(fmt["pattern"], str):
                    raise RequestError("response_format.pattern must be a string")
                return llguidance.LLMatcher.grammar_from_regex(fmt["pattern"])
            if kind == "grammar":
                if not isinstance(fmt["grammar"], str):
                    raise RequestError("response_format.grammar must be a string (Lark or GBNF)")
                return llguidance.grammar_from("grammar", fmt["grammar"])  # Lark, or GBNF converted
        except ValueError as exc:
            raise RequestError(f"response_format ({kind}): {exc}") from None
        raise RequestError(f"response_format type {kind!r} is not a constrained format")


# ---- on the model thread ------------------------------------------------------------


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool for filling many rows' masks at once (drops the GIL)."""
    import llguidance

    return llguidance.LLExecutor()


@functools.cache
def _bit_shifts() -> mx.array:
    """Token 32*w + b is bit b of word w (made on the model thread, at first use)."""
    return mx.arange(32, dtype=mx.int32)


def _message(exc: BaseException) -> str:
    return f"grammar matcher failed: {type(exc).__name__}: {exc}"


class GrammarStep:
    """One step's constrained rows: their bitmask (one MLX array filled through a zero-copy
    view while the forward runs), its application to the logits, and the matchers'
    advance once the tokens are known. Failures are per row, never the step's."""

    def __init__(self, rows: list[tuple[int, str, Any]], num_rows: int, vocab_size: int, bridge: Bridge) -> None:
        """rows: (row of the step's logits, request id, matcher) of `num_rows` rows."""
        import llguidance
        import llguidance.numpy

        self.failed: dict[str, str] = {}
        self.rows = []
        for row, rid, matcher in rows:
            if matcher.is_error():
                self.failed[rid] = f"grammar matcher failed: {matcher.get_error().strip()}"
            else:
                self.rows.append((row, rid, matcher))
        # one row per logits row, all bits set (everything allowed) for free rows: applying
        # it is then one broadcast over the batch, with no gather or scatter of rows
        self.bitmask = mx.full((num_rows, (vocab_size + 31) // 32), -1, dtype=mx.int32)
        view = bridge.to_numpy(self.bitmask)  # evaluates it; the grammar engine writes here
        try:
            llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(mt, row) for row, _, mt in self.rows], view)
        except Exception:  # find the row at fault: fill one by one
            for row, rid, matcher in self.rows:
                try:
                    llguidance.numpy.fill_next_token_bitmask(matcher, view, row)
                except Exception as exc:
                    self.failed[rid] = _message(exc)
        for _, rid, matcher in self.rows:
            if matcher.is_error() and rid not in self.failed:
                self.failed[rid] = f"grammar matcher failed: {matcher.get_error().strip()}"

    def apply(self, logits: mx.array) -> mx.array:
        """Mask every constrained row's disallowed tokens to -inf, on the device."""
        if not self.rows:
            return logits
        rows, vocab = logits.shape
        words = self.bitmask.shape[1]
        allowed = ((self.bitmask[:, :, None] >> _bit_shifts()) & 1).reshape(rows, words * 32)[:, :vocab]
        return mx.where(allowed.astype(mx.bool_), logits, mx.array(-np.inf, dtype=logits.dtype))

    def advance(self, tokens: Mapping[str, int]) -> list[str]:
        """Feed each matcher its sampled token; returns the requests whose grammar is now
        complete (nothing but EOS could follow), which end with finish_reason "stop"."""
        complete = []
        for _, rid, matcher in self.rows:
            if rid in self.failed or rid not in tokens:
                continue
            try:
                ok = matcher.consume_token(tokens[rid])
            except Exception as exc:
                self.failed[rid] = _message(exc)
                continue
            if not ok:
                self.failed[rid] = f"grammar matcher refused token {tokens[rid]}: {matcher.get_error().strip()}"
            elif matcher.is_stopped():
                complete.append(rid)
        return complete
