"""The one place mlx-lm's attention is reached from outside: each attention module's
module-global `scaled_dot_product_attention`, wrapped so that a paged cache can take
the call (the CPU kernels' attention, `cache.cpu_attention`; the decode attention read
straight from the pool, `cache.paged_decode`). Every other cache passes through."""

from __future__ import annotations

import sys
from typing import Any

# the module-level name mlx-lm's attention layers call (mlx_lm.models.base re-exported)
SDPA_NAME = "scaled_dot_product_attention"
_ROUTED = "__unikern_routed__"


def layers_of(model: Any) -> list[Any]:
    """The model's decoder layers (`model.layers` or `model.model.layers`)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
    # a pipeline rank's layers come wrapped (sharding.PipelineBlock): swap inside them
    return [layer.block if getattr(layer, "pipelined", False) else layer for layer in layers or []]


def _calls_sdpa(cls: type) -> bool:
    """Whether `cls`'s own __call__ calls its module's `scaled_dot_product_attention`."""
    code = getattr(cls.__dict__.get("__call__"), "__code__", None)
    return code is not None and SDPA_NAME in code.co_names


def sdpa_module(attn: Any) -> Any:
    """The module whose `scaled_dot_product_attention` the attention module `attn` calls
    (its family's own class: a subclass may wrap its __call__, as fused.py's Fused<...>),
    or None."""
    owner = next((cls for cls in type(attn).__mro__ if _calls_sdpa(cls)), None)
    return None if owner is None else sys.modules[owner.__module__]


def route_attention(layer: Any) -> bool:
    """Wrap the module-global `scaled_dot_product_attention` of `layer`'s attention module.

    No other route exists: mlx-lm's attention modules call their module's
    `scaled_dot_product_attention`, which dispatches on nothing but `cache.bits`, so keeping
    mlx-lm's model code unchanged means wrapping that name. The wrapper passes every call
    through untouched unless the cache is a paged cache with kernels on
    (`cache.cpu_attention`) or a decode step read straight from the pool
    (`cache.paged_decode`, paged_attention.py), so mlx-lm's own generate in the same
    process is unaffected.
    """
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return False
    module = sdpa_module(attn)
    if module is None:
        return False
    original = getattr(module, SDPA_NAME, None)
    if original is None:
        return False
    if getattr(original, _ROUTED, False):
        return True

    def routed(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kwargs):
        paged = getattr(cache, "paged_decode", None)
        if paged is not None and sinks is None and not kwargs:
            out = paged(queries, scale)  # None: not a step it takes
            if out is not None:
                return out
        attention = getattr(cache, "cpu_attention", None)
        if attention is not None and sinks is None and not kwargs:
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)

    setattr(routed, _ROUTED, True)
    routed.__wrapped__ = original
    setattr(module, SDPA_NAME, routed)
    return True
