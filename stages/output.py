"""output: token ids in; text events out, with streaming detokenization and stop strings."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from unikern import messages as m
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox


class OutputParams(StageParams, frozen=True):
    """The output stage has no settings: detokenization and stop strings follow each request."""


class TextStream:
    """One request's text. Each token's text is what decoding it in context adds:
    decode(context + generated)[len(decode(context)):], so a leading space stays (the
    caller appends the text to its prompt) and a character split across tokens comes out
    whole with the token that completes it. Only a window is decoded per token: the
    tokens since the last text went out and the ones before them (the prompt's last few,
    at first). Holds back text that could still become a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...],
                 context: tuple[int, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids = list(context)  # the window: tokens whose text is out, then ones whose is not
        self.read = len(self.ids)  # ids[:read] have their text out
        self.prefix = decode(self.ids) if self.ids else ""  # decode(ids[:read])
        self.pending = ""  # decoded but not yet emitted
        self.emitted_tokens = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a token; return the text now safe to emit. Sets `stopped` on a stop string."""
        self.ids.append(token_id)
        self.emitted_tokens += 1
        return self._emit(self._decoded(final=False), final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self._decoded(final=True), final=True)

    def _decoded(self, final: bool) -> str:
        """The new text of the window, "" while it ends in an incomplete character (its
        bytes decode to U+FFFD until the rest comes; at the end they stay U+FFFD)."""
        text = self.decode(self.ids)
        if len(text) <= len(self.prefix) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(self.prefix):]
        # the next window starts at the tokens this text came from: their context
        del self.ids[: self.read]
        self.read = len(self.ids)
        self.prefix = self.decode(self.ids)
        return new

    def _emit(self, text: str, final: bool) -> str:
        if not self.stop:  # nothing to hold back: pending stays empty
            return text
        self.pending += text
        return self._release(final)

    def _release(self, final: bool) -> str:
        if self.stop:
            cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                text, self.pending = self.pending[:cut], ""
                return text
        keep = 0 if final or not self.stop else self.holdback
        split = max(len(self.pending) - keep, 0)
        text, self.pending = self.pending[:split], self.pending[split:]
        return text


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode` (special tokens kept, as callers' decode does), or the same
    through the Rust tokenizer alone where transformers' layers above it add nothing (its
    stock decode, no space clean-up): ~1 us instead of ~3.4 for a few ids."""
    decode = tokenizer.decode
    hf = getattr(decode, "__self__", None)  # mlx-lm's wrapper hands out the HF tokenizer's
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode as it is
        return decode
    stock = (isinstance(hf, TokenizersBackend) and type(hf).decode is PreTrainedTokenizerBase.decode
             and type(hf)._decode is TokenizersBackend._decode and not hf.clean_up_tokenization_spaces)
    backend = getattr(hf, "backend_tokenizer", None) if stock else None
    if not isinstance(backend, Tokenizer):
        return decode
    raw = backend.decode
    return lambda ids: raw(ids, skip_special_tokens=False)


class AbortOutbox:
    """Aborts for schedule that never make output wait on schedule. schedule <-> output is
    a cycle of bounded inboxes: were output to block on a full schedule inbox while
    schedule blocks on output's, both would wait forever. An abort that does not fit at
    once waits here (at most one per request in flight) for a task of its own."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.pending: deque[str] = deque()
        self._wake = anyio.Event()

    def push(self, request_id: str) -> None:
        if not self.pending:
            try:
                self.ctx.send_nowait(m.Abort(request_id, "stop"))
                return
            except anyio.WouldBlock:
                pass
        self.pending.append(request_id)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self.pending:
                await self.ctx.send(m.Abort(self.pending[0], "stop"))
                self.pending.popleft()


class OutputStage(StageBase):
    Params = OutputParams
    consumes = (m.StepOutput,)
    produces = (m.EventBatch, m.Abort)
    requires = ("tokenizer",)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        decode = text_decoder(ctx.resource("tokenizer"))
        streams: dict[str, TextStream] = {}
        stopped: set[str] = set()
        outbox = AbortOutbox(ctx)

        async def handle(output: m.StepOutput) -> None:
            events: list[m.Event] = []
            aborts: list[str] = []
            for token in output.tokens:
                rid = token.request_id
                if rid in stopped:
                    continue
                stream = streams.get(rid)
                if stream is None:
                    stream = streams[rid] = TextStream(decode, token.stop, token.context)
                text = stream.add(token.token_id)
                if token.last:
                    text += stream.finish()
                events.append(m.TokenEvent(
                    id=rid, token_id=token.token_id, text=text,
                    logprob=token.logprob, top_logprobs=token.top_logprobs,
                ))
                if stream.stopped:
                    stopped.add(rid)
                    aborts.append(rid)
            for done in output.finished:
                rid, reason, usage = done.request_id, done.reason, done.usage
                stream = streams.pop(rid, None)
                if done.error is not None and rid not in stopped:  # this request failed alone
                    events.append(m.ErrorEvent(id=rid, code="processor_failed", message=done.error))
                    continue
                if rid in stopped:
                    stopped.discard(rid)
                    reason = "stop"
                    usage = m.Usage(usage.prompt_tokens, stream.emitted_tokens, usage.cached_tokens)
                events.append(m.DoneEvent(id=rid, finish_reason=reason, usage=usage,
                                          prompt_logprobs=done.prompt_logprobs))
            if events:
                await ctx.send(m.EventBatch(tuple(events)))
            for rid in aborts:
                outbox.push(rid)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(outbox.run)
                task_status.started()
                await serve_inbox(ctx, handle)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # a fault is reported as itself, not as a group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
