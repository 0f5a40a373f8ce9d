"""Messages that flow between stages: frozen msgspec Structs tagged by class name, each
routed to the one stage that consumes its type. KV bytes never travel in messages, only
request ids, token ids, block ids and tables do."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["length", "stop", "cancelled", "error"]


class Message(msgspec.Struct, frozen=True, tag=True):
    """Base of every routed message."""


class SamplingParams(msgspec.Struct, frozen=True):
    """Everything that decides how one request's tokens are drawn and reported; the
    meaning of each field is mlx-lm's (`make_sampler`, `make_logits_processors`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # and this many alternatives (0-20)
    # {"type": "json_object" | "json_schema" | "regex" | "grammar", ...}; None: free text
    response_format: dict[str, Any] | None = None
    # report each prompt token's log-probability and this many alternatives (0-20),
    # computed in the prefill (the prefix cache is not read); None: off
    prompt_logprobs: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# ---- ingress: what the engine facade injects ---------------------------------------


class Submit(Message, frozen=True):
    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    # per-request callables on the step's logits: travel by reference with the request
    # (messages never leave the process), applied on the model thread
    processors: tuple[Any, ...] = ()


class Cancel(Message, frozen=True):
    """Routed through tokenize, like Submit, so that it can never overtake its request."""

    request_id: str


# ---- tokenize -> schedule -----------------------------------------------------------


class Tokenized(Message, frozen=True):
    request_id: str
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    processors: tuple[Any, ...] = ()
    # the request's own grammar matcher (response_format, compiled by tokenize); advanced
    # on the model thread with each sampled token, by reference like the processors
    grammar: Any = None


class Abort(Message, frozen=True):
    """End a request early: cancelled by the caller, or a stop string matched."""

    request_id: str
    reason: FinishReason


# ---- schedule <-> execute: the step loop --------------------------------------------


class SeqWork(msgspec.Struct, frozen=True):
    """One sequence's share of a step: feed `token_ids` at positions start.., then
    sample one token if `sample` (the last chunk of a prefill, or a decode)."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    # generated so far (needed by seeded sampling and logits processors)
    num_generated: int = 0
    processors: tuple[Any, ...] = ()
    # prompt + generated tokens, only for requests with logits processors or penalties
    history: tuple[int, ...] = ()
    grammar: Any = None  # Tokenized.grammar
    # models with recurrent layers: the request's slot in the state pool; before this
    # forward the slot is set from slot `state_from` if >= 0 (0: the zero slot, a
    # checkpoint: a prefix hit); at each (position, slot) of `state_saves` (logical block
    # boundaries of the prompt) the state is copied into that checkpoint slot
    state_slot: int = -1
    state_from: int = -1
    state_saves: tuple[tuple[int, int], ...] = ()
    # a mixed model whose windowed layers keep their own tables (kv layer groups): their
    # table, in their own pool's id space, one entry per logical block as `block_table`
    # (the zero block where a block left the window); () when every layer reads block_table
    window_table: tuple[int, ...] = ()
    # a window planned before the previous one's tokens came back (schedule's
    # overlap_windows): the row's input is the token the previous step sampled last,
    # still on the device; token_ids holds a placeholder of the same length (1)
    continues: bool = False
    # SamplingParams.prompt_logprobs: the prompt tokens that follow the fed positions, from
    # the first one on (at most len(token_ids)); each one's log-probability under its
    # position's logits comes back in StepDone.prompt_logprobs. (): none asked
    prompt_targets: tuple[int, ...] = ()


class Step(Message, frozen=True):
    step_id: int
    work: tuple[SeqWork, ...]
    # decode lookahead: when every row is a decode and nobody waits, run this many
    # decode steps back to back, each feeding the token the previous one sampled
    num_steps: int = 1
    # partial prefix hits: (source block, dest block, tokens): before anything else, the
    # first `tokens` slots of the cached source block are copied into the same slots of
    # a row's fresh dest block, in every layer
    copies: tuple[tuple[int, int, int], ...] = ()


class TopLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float


class PromptLogprob(msgspec.Struct, frozen=True):
    """A prompt token's log-probability given the tokens before it, and the most likely
    tokens at its position, best first (SamplingParams.prompt_logprobs of them)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


class Logprobs(msgspec.Struct, frozen=True):
    """One sampled token's log-probability and the most likely tokens, best first."""

    logprob: float
    top: tuple[TopLogprob, ...] = ()


class WindowTokens(Message, frozen=True):
    """A decode window's tokens so far, sent while the window still runs
    (execute.stream_interval_ms): each row's first tokens of the window, in order. Only for
    streaming: the StepDone that ends the window carries every token again, and the books
    (blocks, positions, finishes) move only with it."""

    step_id: int
    sampled: dict[str, list[int]]


class StepDone(Message, frozen=True):
    step_id: int
    # request_id -> sampled token ids (one per step of a lookahead run), for every
    # SeqWork with sample=True that did not fail
    sampled: dict[str, list[int]]
    # request_id -> one report per sampled token, for requests that asked (logprobs)
    logprobs: dict[str, list[Logprobs]] = {}
    # request_id -> why that request alone failed in this step (its logits processor,
    # grammar matcher or sampler): it ends with an error, the others go on
    failed: dict[str, str] = {}
    # requests whose grammar completed with their last sampled token
    stopped: tuple[str, ...] = ()
    # request_id -> one report per SeqWork.prompt_targets entry, in order
    prompt_logprobs: dict[str, list[PromptLogprob]] = {}


# ---- schedule <-> offload: moving blocks between tiers -------------------------------


class BlockRef(msgspec.Struct, frozen=True):
    """A logical block of the pool and the chained hash that names its contents."""

    block_id: int
    block_hash: bytes
    # a mixed model's windowed layers in their own pool (kv layer groups): the block of
    # the same hash there; -1 when every layer lives in block_id's pool
    window_block_id: int = -1


class StateRef(msgspec.Struct, frozen=True):
    """A recurrent-state checkpoint slot holding the state after the first `num_tokens`
    prompt tokens, whose last full block is named `block_hash`."""

    slot: int
    block_hash: bytes
    num_tokens: int


class LoadBlocks(Message, frozen=True):
    """Fill these (allocated, pinned) blocks from the disk tier, in chain order, before
    `request_id` is scheduled; and the (reserved) checkpoint slot `state`, if given."""

    request_id: str
    blocks: tuple[BlockRef, ...]
    state: StateRef | None = None


class BlocksLoaded(Message, frozen=True):
    """The first `num_loaded` blocks of a LoadBlocks hold verified data; the rest do not
    (missing or corrupt: the request recomputes them). `state_loaded`: the state slot
    holds its verified checkpoint."""

    request_id: str
    blocks: tuple[BlockRef, ...]
    num_loaded: int
    state: StateRef | None = None
    state_loaded: bool = False


class StoreBlocks(Message, frozen=True):
    """Write these full, committed (and pinned) blocks, and these committed (and pinned)
    state checkpoints, to the disk tier."""

    blocks: tuple[BlockRef, ...]
    states: tuple[StateRef, ...] = ()


class BlocksStored(Message, frozen=True):
    """The pool memory of these blocks and checkpoint slots has been read (their bytes are
    on their way to disk, or skipped): they may be unpinned."""

    blocks: tuple[BlockRef, ...]
    states: tuple[StateRef, ...] = ()


# ---- schedule -> output -------------------------------------------------------------


# Prompt tokens a request's text is decoded after: enough to start the window at a
# character and to give SentencePiece's first-token space strip a token to act on.
DETOKENIZE_CONTEXT = 4


class TokenOut(Message, frozen=True):
    request_id: str
    token_id: int
    # the request's final token (EOS, max_tokens, context end): flush held-back text
    last: bool = False
    # the request's stop strings, sent with its first token only
    stop: tuple[str, ...] = ()
    # the prompt's last tokens (DETOKENIZE_CONTEXT), sent with its first token only: the
    # text of generated tokens is what they add to it (a leading space stays)
    context: tuple[int, ...] = ()
    logprob: float | None = None  # only for requests that asked
    top_logprobs: tuple[TopLogprob, ...] | None = None


class Finished(Message, frozen=True):
    request_id: str
    reason: FinishReason
    usage: Usage
    # reason "error": why the request failed alone (an `error` event, code processor_failed)
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one per token
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


class StepOutput(Message, frozen=True):
    """What one step (or one abort) produced, in order: one message per step, not per
    token, so 64 requests x 8 lookahead tokens cost one hop instead of 512."""

    tokens: tuple[TokenOut, ...] = ()
    finished: tuple[Finished, ...] = ()


# ---- egress: what the engine facade hands to callers --------------------------------


class EventBase(msgspec.Struct, frozen=True, tag_field="event"):
    """Base of the events callers see; `event` is the tag, as in the worker protocol."""


class TokenEvent(EventBase, frozen=True, tag="token", omit_defaults=True):
    id: str
    token_id: int
    text: str
    # only for requests that asked (SamplingParams.logprobs / top_logprobs)
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None


class DoneEvent(EventBase, frozen=True, tag="done", omit_defaults=True):
    id: str
    finish_reason: FinishReason
    usage: Usage
    # only for requests that asked (SamplingParams.prompt_logprobs): null for the first
    # prompt token, then {token_id, logprob, top_logprobs} for each one after it
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


class ErrorEvent(EventBase, frozen=True, tag="error"):
    id: str | None
    code: str
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent


class EventBatch(Message, frozen=True):
    """Several events for the engine at once (one step's worth, from output)."""

    events: tuple[Event, ...]
