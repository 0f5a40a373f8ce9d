"""output: token ids in; text events out, with streaming detokenization and stop strings."""

from __future__ import annotations

from typing import Any

from unikern import messages as m
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox


class OutputParams(StageParams, frozen=True):
    pass


class TextStream:
    """One request's detokenizer. Holds back text that could still become a stop string,
    and never splits a multi-byte character (mlx-lm's streaming detokenizers wait for
    whole characters)."""

    def __init__(self, detokenizer: Any, stop: tuple[str, ...]) -> None:
        self.detok = detokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded but not yet emitted
        self.emitted_tokens = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a token; return the text now safe to emit. Sets `stopped` on a stop string."""
        self.detok.add_token(token_id)
        self.emitted_tokens += 1
        self.pending += self.detok.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.detok.finalize()
        self.pending += self.detok.last_segment
        return self._release(final=True)

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


class OutputStage(StageBase):
    Params = OutputParams
    consumes = (m.TokenOut, m.Finished)
    produces = (m.TokenEvent, m.DoneEvent, m.Abort)
    requires = ("tokenizer",)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        tokenizer = ctx.resource("tokenizer")
        streams: dict[str, TextStream] = {}
        stopped: set[str] = set()
        task_status.started()

        async def handle(message: Any) -> None:
            match message:
                case m.TokenOut(request_id=rid, token_id=token_id, last=last):
                    if rid in stopped:
                        return
                    stream = streams.get(rid)
                    if stream is None:
                        stream = streams[rid] = TextStream(tokenizer.detokenizer, message.stop)
                    text = stream.add(token_id)
                    if last:
                        text += stream.finish()
                    await ctx.send(m.TokenEvent(id=rid, token_id=token_id, text=text))
                    if stream.stopped:
                        stopped.add(rid)
                        await ctx.send(m.Abort(rid, "stop"))
                case m.Finished(request_id=rid, reason=reason, usage=usage):
                    stream = streams.pop(rid, None)
                    if rid in stopped:
                        stopped.discard(rid)
                        reason = "stop"
                        usage = m.Usage(usage.prompt_tokens, stream.emitted_tokens, usage.cached_tokens)
                    await ctx.send(m.DoneEvent(id=rid, finish_reason=reason, usage=usage))

        await serve_inbox(ctx, handle)
