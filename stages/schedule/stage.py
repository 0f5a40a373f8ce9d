"""schedule: the step loop. Keeps one step in flight; plans the next as soon as the
previous one returns, so requests join and leave between any two steps. With
`overlap_windows`, a decode window's successor for the same rows goes out while it runs
(two in flight), so the model thread starts it without waiting for this round trip."""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

from unikern import messages as m
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.schedule.policy import Scheduler

# Four steps' worth of rows keep every slot refilled as sequences finish, and a request
# at the back waits a few generations, not minutes. A waiting request holds only its
# prompt (no KV), so the floor lets a burst queue even when max_num_seqs is set low to
# save memory.
MIN_WAITING = 256


class ScheduleParams(StageParams, frozen=True):
    max_num_seqs: int = 64
    """Sequences (rows) in one step, at most (>= 1): more rows share each pass over the weights and
    need more KV memory."""
    max_num_batched_tokens: int = 2048
    """Tokens in one step, at most (>= `max_num_seqs`): the chunked-prefill budget shared by the
    prompts and decodes of a step."""
    max_prefill_chunk: int = 512
    """Tokens of one prompt in one step, at most (>= 1); a longer prompt is prefilled over several steps."""
    decode_lookahead: int = 8
    """Decode steps run back to back as one window (>= 1) when only decodes run and nobody waits: more
    hides per-step overhead, fewer lets new requests join sooner."""
    decode_lookahead_max: int = 32
    """While the same rows keep decoding, each window doubles the last, up to this many steps (>= 1;
    at or below `decode_lookahead`: never grows)."""
    max_waiting: int | None = None
    """Requests queued for a free slot, at most (>= 1); one more is refused at once with an
    `overloaded` error. null: 4 x `max_num_seqs`, at least 256."""
    overlap_windows: bool | Literal["auto"] = "auto"
    """Send the next decode window of the same rows while one runs, fed the tokens still on the device,
    so the model thread starts it without waiting for the step's result to come back through this stage
    (not for rows with penalties, processors or grammars). `auto`: on where MLX runs on CUDA: on an H200
    (1B) 16 requests ran 1.31x faster, 6 of 6 repeats (tools/bench/bench_ab.py); on CPU it made no difference."""
    overlap_prefill: bool = False
    """With `overlap_windows`, a row's first decode window goes out while its prompt's step runs, too;
    requests arriving just after wait for that window. Off: on an H200 (1B), on together with
    `execute.compile_prefill`, 64 requests were slower in 5 of 6 repeats (tools/bench/bench_ab.py)."""

    def waiting_limit(self) -> int:
        return self.max_waiting if self.max_waiting is not None else max(MIN_WAITING, 4 * self.max_num_seqs)

    def validate(self) -> list[str]:
        problems = []
        if self.max_waiting is not None and self.max_waiting < 1:
            problems.append(f"max_waiting: must be >= 1, got {self.max_waiting}")
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_prefill_chunk < 1:
            problems.append(f"max_prefill_chunk: must be >= 1, got {self.max_prefill_chunk}")
        if self.decode_lookahead < 1:
            problems.append(f"decode_lookahead: must be >= 1, got {self.decode_lookahead}")
        if self.decode_lookahead_max < 1:
            problems.append(f"decode_lookahead_max: must be >= 1, got {self.decode_lookahead_max}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            problems.append(
                f"max_num_batched_tokens: must be >= max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}"
            )
        return problems


class ScheduleStage(StageBase):
    Params = ScheduleParams
    consumes = (m.Tokenized, m.Abort, m.StepDone, m.WindowTokens)
    produces = (m.Step, m.StepOutput, m.ErrorEvent)
    requires = ("kv", "model", "tokenizer")

    async def run(self, ctx: StageContext, *, task_status) -> None:
        kv = ctx.resource("kv")
        loaded = ctx.resource("model")
        tokenizer = ctx.resource("tokenizer")
        self.scheduler = Scheduler(
            kv.blocks,
            max_num_seqs=self.params.max_num_seqs,
            max_num_batched_tokens=self.params.max_num_batched_tokens,
            eos_token_ids=tokenizer.eos_token_ids,
            context_length=loaded.context_length,
            decode_lookahead=self.params.decode_lookahead,
            decode_lookahead_max=self.params.decode_lookahead_max,
            max_prefill_chunk=self.params.max_prefill_chunk,
            max_waiting=self.params.waiting_limit(),
            geometry=loaded.geometry,
            state_checkpoints=kv.state_checkpoints,
            window_blocks=kv.window_blocks,
        )
        self.in_flight: deque[m.Step] = deque()  # sent, in order; two with overlap_windows
        self.overlap = self.overlap_on(self.params.overlap_windows)
        self.scheduler.follow_prefills = self.overlap and self.params.overlap_prefill
        self.setup(ctx)
        task_status.started()

        async def handle(message: Any) -> None:
            await self.step(ctx, await self.handle(ctx, message))

        await serve_inbox(ctx, handle)

    async def step(self, ctx: StageContext, output: m.StepOutput | None) -> None:
        """One turn of the engine: the policy plans the next Step (Scheduler.schedule),
        the execute stage runs it on the model thread and answers StepDone, which
        Scheduler.on_step_done turns into this StepOutput for the output stage. The next
        step goes out before this one's tokens, so the model computes while the event
        loop detokenizes and delivers."""
        if not self.in_flight and self.scheduler.has_work():
            step = self.scheduler.schedule()
            if step is not None:
                self.in_flight.append(step)
                await ctx.send(step)
        if self.overlap and len(self.in_flight) == 1:
            follow = self.scheduler.follow_up(self.in_flight[0])
            if follow is not None:
                self.in_flight.append(follow)
                await ctx.send(follow)
        if output is not None and (output.tokens or output.finished):
            await ctx.send(output)

    @staticmethod
    def overlap_on(setting: bool | str) -> bool:
        if setting == "auto":
            from unikern.platform import cuda_is_default

            return cuda_is_default()
        return bool(setting)

    def setup(self, ctx: StageContext) -> None:
        """Hook for subclasses: runs once the scheduler exists, before start-up ends."""

    async def on_tokenized(self, ctx: StageContext, request: m.Tokenized) -> bool:
        """Queue the request or send its refusal (the policy decides); True if queued."""
        refusal = self.scheduler.add(request)
        if refusal is not None:
            await ctx.send(m.ErrorEvent(id=request.request_id, code=refusal.code, message=refusal.message))
        return refusal is None

    async def handle(self, ctx: StageContext, message: Any) -> m.StepOutput | None:
        """Act on one message; returns the output to send once the next step is out."""
        sched = self.scheduler
        match message:
            case m.Tokenized():
                await self.on_tokenized(ctx, message)
            case m.Abort(request_id=rid, reason=reason):
                finished = sched.abort(rid, reason)
                if finished is not None:
                    return m.StepOutput(finished=(finished,))
            case m.StepDone(step_id=step_id, sampled=sampled):
                step = self.in_flight.popleft() if self.in_flight else None
                if step is None or step.step_id != step_id:
                    raise RuntimeError(f"step {step_id} came back, but step {step and step.step_id} was in flight")
                outcome = sched.on_step_done(step, sampled, message.logprobs, message.failed, message.stopped,
                                             message.prompt_logprobs)
                return m.StepOutput(tuple(outcome.tokens), tuple(outcome.finished))
            case m.WindowTokens(step_id=step_id, sampled=sampled):  # the window in flight, first of all
                step = self.in_flight[0] if self.in_flight else None
                if step is None or step.step_id != step_id:
                    raise RuntimeError(f"tokens of step {step_id} came, but step {step and step.step_id} was in flight")
                return m.StepOutput(tuple(sched.on_window_tokens(step, sampled)))
        return None

    def stats(self) -> dict[str, Any]:
        sched = getattr(self, "scheduler", None)
        if sched is None:
            return {}
        return {
            "schedule": {
                "waiting": len(sched.waiting),
                "running": len(sched.running),
                "preemptions": sched.num_preemptions,
                "overlap_windows": self.overlap,
                "overlap_prefill": sched.follow_prefills,
                "follow_ups": sched.num_follow_ups,
                "max_waiting": sched.max_waiting,
                "refused_overloaded": sched.num_refused_overloaded,
            },
            # the state books live with the policy; they belong in the kv section (merged)
            **({"kv": {"states": sched.states.books.stats()}} if sched.states is not None else {}),
        }
