"""A model cut for one rank: tensor parallel through mlx-lm's own `Model.shard` (heads
and MLP columns split, its `all_sum`s combine them), or pipeline parallel by a generic
split of `model.model.layers` (hidden states passed with send/recv, the last rank's
output gathered to every rank so each computes the same logits)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from unikern.errors import ConfigError


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


class PipelineBlock(nn.Module):
    """One layer of a pipeline rank, with the hops around it: receive the hidden state
    from the rank before (first local layer), send it on and gather the last rank's
    output everywhere (last local layer)."""

    pipelined = True

    def __init__(self, block: nn.Module, receive_from: int | None, send_to: int | None, gather: bool, group: Any):
        super().__init__()
        self.block = block
        # plain Python attributes, not module state: kept out of parameters()
        object.__setattr__(self, "_hops", (receive_from, send_to, gather, group))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the model's loop reads of a layer (use_sliding, ...)
            block = dict.get(self, "block")
            if block is None:
                raise
            return getattr(block, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        receive_from, send_to, gather, group = self._hops
        if receive_from is not None:
            h = mx.distributed.recv_like(h, receive_from, group=group)
        out = self.block(h, *args, **kwargs)
        if send_to is not None:
            out = mx.distributed.send(out, send_to, group=group)
        if gather:
            out = mx.distributed.all_gather(out, group=group)[: out.shape[0]]
            # evaluated here, so that every rank runs its send and the gather inside each
            # forward, whatever the caller evaluates (only the pool's writes, a probe's cache)
            mx.eval(out)
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
    inner.layers = [
        PipelineBlock(
            layer,
            receive_from=rank + 1 if i == 0 and rank < size - 1 else None,
            send_to=rank - 1 if i == last and rank > 0 else None,
            gather=i == last,
            group=group,
        )
        for i, layer in enumerate(local)
    ]
    if hasattr(inner, "fa_idx"):
        inner.fa_idx = 0  # the mask comes from this rank's first cache (every layer full attention)
    if hasattr(inner, "num_hidden_layers"):
        inner.num_hidden_layers = len(local)
    return start, end
