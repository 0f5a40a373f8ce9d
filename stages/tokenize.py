"""tokenize: text, chat messages or token ids in; validated prompt tokens out."""

from __future__ import annotations

import time
from typing import Any

from unikern import messages as m
from unikern.errors import RequestError
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.execute.structured import GrammarCompiler
from unikern.stages.models import DEFAULT_MODEL, resolve_model_path


class TokenizeParams(StageParams, frozen=True):
    model: str = DEFAULT_MODEL
    """The model whose tokenizer and chat template are used: a directory in MLX layout, a hub repo id
    (fetched by mlx-lm, which needs the network), or `default`, the small model shipped with unikern."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this many tokens (>= 1) are refused before they reach the scheduler;
    null: the model's context length."""

    def validate(self) -> list[str]:
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            return [f"max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}"]
        return []


class PromptEncoder:
    """Plain synchronous tokenization with the model's own tokenizer (as mlx-lm loads it)."""

    def __init__(self, model: str, max_prompt_tokens: int | None = None) -> None:
        from mlx_lm.utils import load_config, load_tokenizer

        path = resolve_model_path(model)
        self.config = load_config(path)
        self.tokenizer = load_tokenizer(path, eos_token_ids=self.config.get("eos_token_id"))
        self.model_path = path
        self.vocab_size = int(self.config.get("vocab_size", len(self.tokenizer)))
        self.context_length = int(
            self.config.get("max_position_embeddings")
            or self.config.get("max_seq_len")
            or getattr(self.tokenizer, "model_max_length", 0)
            or 4096
        )
        self.max_prompt_tokens = max_prompt_tokens or self.context_length

    def encode(self, request: m.Submit) -> tuple[int, ...]:
        if request.prompt_tokens is not None:
            tokens = request.prompt_tokens
            bad = [t for t in tokens if not (0 <= t < self.vocab_size)]
            if bad:
                raise RequestError(
                    f"prompt_tokens: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        elif request.messages is not None:
            tokens = self._encode_chat(request.messages)
        else:
            if not request.prompt:
                raise RequestError("prompt: the prompt is empty; give at least one character")
            tokens = self._encode_text(request.prompt)
        if not tokens:
            raise RequestError("the prompt is empty: give at least one token")
        biased = [t for t, _ in request.params.logit_bias if t >= self.vocab_size]
        if biased:
            raise RequestError(f"logit_bias: ids {biased[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(tokens) >= self.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens; this model serves at most "
                f"{self.max_prompt_tokens - 1} prompt tokens (context {self.context_length})",
                code="prompt_too_long",
            )
        return tuple(int(t) for t in tokens)

    def _encode_text(self, text: str) -> list[int]:
        return text_prompt_tokens(self.tokenizer, text)

    def _encode_chat(self, chat: tuple[dict[str, Any], ...]) -> list[int]:
        for i, turn in enumerate(chat):
            if not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
                raise RequestError(
                    f"messages[{i}]: expected {{'role': str, 'content': str}}, got {turn!r}"
                )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model has no chat template: send `prompt` instead of `messages`")
        return chat_prompt_tokens(self.tokenizer, list(chat))


def text_prompt_tokens(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's token ids, with the same BOS rule mlx_lm.generate applies (the HTTP
    door's echo names the tokens the engine will see)."""
    bos = tokenizer.bos_token
    add_special = bos is None or not text.startswith(bos)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special)]


def chat_prompt_tokens(tokenizer: Any, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids of a conversation through the model's chat template, ready for
    the assistant's turn; a template that fails is a RequestError saying why."""
    try:
        tokens = tokenizer.apply_chat_template(turns, tools=tools or None, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own raise_exception, or a bad turn
        raise RequestError(f"messages: the chat template failed: {exc}") from exc
    if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
        tokens = tokens["input_ids"]
    return [int(t) for t in tokens]


class TokenizeStage(StageBase):
    Params = TokenizeParams
    consumes = (m.Submit, m.Cancel)
    produces = (m.Tokenized, m.Abort, m.ErrorEvent)
    provides = ("tokenizer",)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        import anyio

        started = time.perf_counter()
        self.encoder = await anyio.to_thread.run_sync(
            PromptEncoder, self.params.model, self.params.max_prompt_tokens
        )
        # beside the model's load (stats.model.startup, Engine.startup)
        self.startup = {"tokenizer_s": round(time.perf_counter() - started, 3)}
        tokenizer = self.encoder.tokenizer
        self.grammars = GrammarCompiler(
            getattr(tokenizer, "_tokenizer", tokenizer), tokenizer.eos_token_ids, self.encoder.vocab_size
        )

        async def grammar_for(params: m.SamplingParams) -> Any:
            """The request's own matcher; a format not seen before compiles on a worker
            thread (milliseconds to a second), never on the event loop."""
            fmt = params.response_format
            if fmt is None:
                return None
            found = self.grammars.matcher(fmt)
            return found if found is not None else await anyio.to_thread.run_sync(self.grammars.compile, fmt)

        ctx.provide("tokenizer", self.encoder.tokenizer)
        ctx.provide("model_name", str(self.params.model))
        task_status.started()

        async def handle(message: Any) -> None:
            match message:
                case m.Submit():
                    try:
                        tokens = self.encoder.encode(message)
                        grammar = await grammar_for(message.params)
                    except RequestError as exc:
                        await ctx.send(m.ErrorEvent(id=message.request_id, code=exc.code, message=str(exc)))
                        return
                    await ctx.send(
                        m.Tokenized(message.request_id, tokens, message.params, message.processors, grammar)
                    )
                case m.Cancel():
                    await ctx.send(m.Abort(message.request_id, "cancelled"))

        await serve_inbox(ctx, handle)

    def stats(self) -> dict[str, Any]:
        grammars = getattr(self, "grammars", None)
        if grammars is None:
            return {}
        return {"structured": {"formats_compiled": grammars.compiled, "formats_cached": len(grammars._cache)}}
