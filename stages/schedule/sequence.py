"""A request as the scheduler keeps it (tokens, block tables, progress), and what its
policy hands back: refusals and step outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unikern import messages as m


def needs_history(seq: Sequence) -> bool:
    """Logits processors see every token so far; penalties look at the latest ones."""
    p = seq.params
    penalized = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    return bool(seq.processors) or penalized


def prompt_targets(seq: Sequence, start: int, num_tokens: int) -> tuple[int, ...]:
    """SeqWork.prompt_targets of a chunk: the prompt tokens after each of its positions, for
    a request that asked for the prompt's log-probabilities (none past the prompt's end)."""
    if seq.params.prompt_logprobs is None:
        return ()
    return tuple(seq.tokens[start + 1 : min(start + num_tokens + 1, seq.num_prompt_tokens)])


@dataclass(eq=False)  # an entity: compared by identity (membership tests run per row per step)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: m.SamplingParams
    processors: tuple = ()  # per-request callables on the logits (Submit.processors)
    grammar: Any = None  # the request's grammar matcher (Tokenized.grammar)
    num_computed: int = 0  # tokens whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)  # a mixed model's window group (groups.py)
    block_hashes: list[bytes] = field(default_factory=list)  # of full, committed blocks
    cached_tokens: int | None = None  # set at first admission
    num_preemptions: int = 0
    # blocks held for this sequence until its first admission (its prefix, just loaded
    # from a lower tier), so nothing evicts them while it waits
    pinned: list[int] = field(default_factory=list)
    held: bool = False  # not admissible yet: its prefix is still loading
    streamed: int = 0  # tokens of the window in flight already sent out (WindowTokens)
    # a partial prefix hit's cached source block, one reference held from admission until
    # the step that copies it comes back, or until the sequence ends or is preempted first
    copy_source: int | None = None
    # SamplingParams.prompt_logprobs: the reports of prompt tokens 1.. so far, in order
    prompt_reports: list[m.PromptLogprob] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def prompt_logprobs(self) -> tuple[m.PromptLogprob | None, ...] | None:
        """What the done event carries: None for the first token (nothing comes before it);
        None in all when not asked, or not all computed (cancelled during the prefill)."""
        if self.params.prompt_logprobs is None or len(self.prompt_reports) != self.num_prompt_tokens - 1:
            return None
        return (None, *self.prompt_reports)

    @property
    def usage(self) -> m.Usage:
        # tokens of a window in flight already sent out count too (the request ends before its StepDone)
        return m.Usage(self.num_prompt_tokens, self.num_generated + self.streamed, self.cached_tokens or 0)


@dataclass(frozen=True)
class Refusal:
    """Why `Scheduler.add` turned a request away: `code` is the error event's code."""

    code: str  # "bad_request" (can never be served) or "overloaded" (try again later)
    message: str


@dataclass
class StepOutcome:
    tokens: list[m.TokenOut] = field(default_factory=list)
    finished: list[m.Finished] = field(default_factory=list)
