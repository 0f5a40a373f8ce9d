"""The model as the pipeline knows it: loaded by mlx-lm, probed for the KV geometry the
pool needs, and named by an identity that keys the prefix cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from unikern.stages.execute.thread import ModelThread
from unikern.stages.kv.cache_kinds import needs_zeroing
from unikern.stages.models import resolve_model_path


class ModelGeometry:
    """What the KV pool needs to know about a model, probed by running it once."""

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(model)
        kinds = {type(c).__name__ for c in cache}
        stateful = sorted(k for k in kinds if needs_zeroing(k))
        if stateful:
            raise NotImplementedError(
                f"this model keeps recurrent or quantized state ({', '.join(stateful)}), which "
                "must start zeroed and needs state checkpoints per block; the paged pool "
                "serves attention-only models (KVCache) so far"
            )
        if any(type(c) is not KVCache for c in cache):
            raise NotImplementedError(
                f"this model uses cache kinds {sorted(kinds)} (e.g. sliding windows); the "
                "paged pool serves full-attention KVCache models so far"
            )
        model(mx.array([[0]], dtype=mx.int32), cache=cache)
        mx.eval([c.keys for c in cache])
        shapes = {(c.keys.shape[1], c.keys.shape[3], c.values.shape[3]) for c in cache}
        if len(shapes) != 1:
            raise NotImplementedError(f"layers differ in KV shape {sorted(shapes)}; not supported yet")
        (self.num_kv_heads, self.head_dim, value_dim), = shapes
        if value_dim != self.head_dim:
            raise NotImplementedError("keys and values of different widths are not supported yet")
        self.num_layers = len(cache)
        self.dtype = cache[0].keys.dtype



@dataclass
class LoadedModel:
    """The `model` resource: what other stages may know about the loaded model."""

    name: str
    path: str
    model: Any
    config: dict
    geometry: ModelGeometry
    weights_bytes: int
    identity: bytes  # model + dtype: part of every prefix-cache key
    context_length: int
    thread: ModelThread
    weights: list[mx.array]


def load_model(name: str) -> LoadedModel:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = resolve_model_path(name)
    model, config = mlx_lm_load_model(path)
    weights = [w for _, w in tree_flatten(model.parameters())]
    mx.eval(weights)
    geometry = ModelGeometry(model)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(str(geometry.dtype).encode())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}".encode())
    context = int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)
    return LoadedModel(
        name=name,
        path=str(path),
        model=model,
        config=config,
        geometry=geometry,
        weights_bytes=sum(w.nbytes for w in weights),
        identity=digest.digest(),
        context_length=context,
        thread=None,  # set by the stage
        weights=weights,
    )
