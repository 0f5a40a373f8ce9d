"""A model cut for one rank: tensor parallel through mlx-lm's own `Model.shard` (heads
and MLP columns split, its `all_sum`s combine them), or pipeline parallel by a generic
split of `model.model.layers` (hidden states passed rank to rank, the last layers'
output sent to every rank so each computes the same logits, all by `all_sum`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from unikern.errors import ConfigError


def refuse_unpaged_kinds(model: Any, family: str, mode: str) -> None:
    """Several ranks serve models whose every layer is full attention (mlx-lm's KVCache):
    the other ranks build neither a windowed layers' pool nor recurrent state slots."""
    from mlx_lm.models.cache import make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - {"KVCache"})
    if kinds:
        raise ConfigError(
            f"execute.{mode}_parallel: several ranks serve models with one attention-layer group and no "
            f"recurrent layers so far, and {family} has {', '.join(kinds)} layers; run it on one rank "
            f"(tensor_parallel: 1, pipeline_parallel: 1)"
        )


def shard_tensor_parallel(model: Any, config: dict, group: Any, family: str) -> None:
    """mlx-lm's `shard` for the family, after checking that the heads divide evenly."""
    size = group.size()
    if not hasattr(model, "shard"):
        raise ConfigError(
            f"execute.tensor_parallel: mlx-lm's {family} model has no `shard` method; use "
            f"execute.pipeline_parallel instead, or tensor_parallel: 1"
        )
    counts = {
        "num_attention_heads": config.get("num_attention_heads"),
        "num_key_value_heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
        "intermediate_size": config.get("intermediate_size"),
    }
    uneven = {k: v for k, v in counts.items() if isinstance(v, int) and v % size}
    if uneven:
        raise ConfigError(
            f"execute.tensor_parallel: {size} ranks cannot split {family}'s "
            + ", ".join(f"{k}={v}" for k, v in uneven.items())
            + "; use a tensor_parallel that divides them, or pipeline_parallel"
        )
    model.shard(group)


def _hop(x: mx.array, mine: bool, group: Any) -> mx.array:
    """One hop of the pipeline as an `all_sum` that every rank joins: the sender adds its
    array, every other rank zeros, so each gets the sender's array exactly (x + 0 = x).
    A collective, not send/recv, because MLX's CUDA backend has no send ("Send has no
    CUDA implementation", MLX 0.32 with NCCL). Evaluated at once: a rank that only
    passes a hop on discards its result, and the hops must run in the same order on
    every rank."""
    out = mx.distributed.all_sum(x if mine else mx.zeros(x.shape, x.dtype), group=group)
    mx.eval(out)
    return out


class PipelineBlock(nn.Module):
    """One layer of a pipeline rank, with the hops around it. With N ranks, every forward
    runs the same N - 1 hops (rank N-1's output to rank N-2, ..., rank 1's to rank 0)
    and then rank 0's output to every rank, each hop on every rank (`_hop`): rank r
    passes on the hops above r + 1 and receives r + 1's before its first layer, sends its
    own after its last, then passes on the ones below."""

    pipelined = True

    def __init__(self, block: nn.Module, first: bool, last: bool, group: Any):
        super().__init__()
        self.block = block
        # plain Python attributes, not module state: kept out of parameters()
        object.__setattr__(self, "_hops", (first, last, group))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the model's loop reads of a layer (use_sliding, ...)
            block = dict.get(self, "block")
            if block is None:
                raise
            return getattr(block, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        first, last, group = self._hops
        size, rank = group.size(), group.rank()
        if first:
            for _ in range(size - 1, rank + 1, -1):  # hops between ranks above this one
                _hop(h, False, group)
            if rank < size - 1:  # rank + 1's output: this rank's input
                h = _hop(h, False, group)
        out = self.block(h, *args, **kwargs)
        if last:
            if rank > 0:  # this rank's output to rank - 1
                _hop(out, True, group)
            for _ in range(rank - 1, 0, -1):  # hops between ranks below this one
                _hop(out, False, group)
            out = _hop(out, rank == 0, group)  # rank 0 ran the last layers: its output to all
        return out


def split_layers(model: Any, group: Any, family: str) -> tuple[int, int]:
    """Keep this rank's share of `model.model.layers`, as mlx-lm's PipelineMixin orders
    them: the last rank runs the first layers, rank 0 the last ones (so the logits come
    out on rank 0), the low ranks taking one extra layer each when they do not divide.
    Returns the [start, end) of the layers kept. mlx-lm's own `pipeline()` is not used,
    even where a family has it: its cache list still spans every layer up to this rank's,
    where this split gives each rank's KV pool its own layers only."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ConfigError(f"execute.pipeline_parallel: {family} has no `model.layers` list to split")
    if getattr(inner, "swa_idx", None) is not None:
        raise ConfigError(f"execute.pipeline_parallel: {family} with sliding-window layers is not split yet")
    size, rank = group.size(), group.rank()
    if size > len(layers):
        raise ConfigError(f"execute.pipeline_parallel: {size} ranks for {family}'s {len(layers)} layers; at most {len(layers)}")
    base, extra = divmod(len(layers), size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1 :])
    end = start + split[rank]
    local = layers[start:end]
    last = len(local) - 1
    inner.layers = [PipelineBlock(layer, first=i == 0, last=i == last, group=group) for i, layer in enumerate(local)]
    if hasattr(inner, "fa_idx"):
        inner.fa_idx = 0  # the mask comes from this rank's first cache (every layer full attention)
    if hasattr(inner, "num_hidden_layers"):
        inner.num_hidden_layers = len(local)
    return start, end
