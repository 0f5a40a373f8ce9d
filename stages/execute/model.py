"""The model as the pipeline knows it: loaded by mlx-lm, probed for the KV geometry the
pool needs, and named by an identity that keys the prefix cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from unikern.platform import cuda_is_default, read_ahead
from unikern.stages.execute import paged_cache
from unikern.stages.execute.embeddings import route_embeddings
from unikern.stages.execute.paged_cache import TOKEN_DTYPE
from unikern.stages.execute.ropes import route_ropes
from unikern.stages.execute.thread import ModelThread
from unikern.stages.models import resolve_model_path
from unikern.startup import PhaseClock

# what each mlx-lm cache kind becomes on the paged pool
PAGED_KINDS = {"KVCache": "full", "RotatingKVCache": "window", "ArraysCache": "state"}


@dataclass(frozen=True)
class LayerSlot:
    """One entry of the model's cache list as the pool serves it: an attention layer
    (full or windowed) reads and writes KV pool layer `index`; a recurrent layer keeps
    its arrays in state-pool layer `index`."""

    kind: str  # "full" | "window" | "state"
    index: int
    window: int | None = None  # tokens a windowed layer attends to, itself included
    state: tuple[tuple[tuple[int, ...], mx.Dtype], ...] = ()  # per state array: shape without batch, dtype


class ModelGeometry:
    """What the KV pool needs to know about a model, probed by running it once."""

    def __init__(self, model: Any, family: str = "this model") -> None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        kinds = [type(c).__name__ for c in cache]
        missing = sorted({k for k in kinds if k not in PAGED_KINDS})
        if missing:
            raise NotImplementedError(
                f"{family}: the paged pool has no adapter for mlx-lm cache kinds {missing} yet "
                f"(it serves {sorted(PAGED_KINDS)})"
            )
        if any(getattr(c, "keep", 0) for c in cache):
            raise NotImplementedError(f"{family}: rotating caches that keep their first tokens are not served yet")
        # (token ids in the engine's dtype: on CUDA, another would make MLX compile a gather)
        model(mx.array([[0]], dtype=TOKEN_DTYPE), cache=cache)
        attention = [c for c in cache if kinds_of(c) != "state"]
        mx.eval([c.state for c in cache])
        shapes = {(c.keys.shape[1], c.keys.shape[3], c.values.shape[3]) for c in attention}
        if len(shapes) > 1:
            raise NotImplementedError(f"{family}: attention layers differ in KV shape {sorted(shapes)}; not supported yet")
        if attention:
            (self.num_kv_heads, self.head_dim, value_dim), = shapes
            if value_dim != self.head_dim:
                raise NotImplementedError(f"{family}: keys and values of different widths are not supported yet")
            self.dtype = attention[0].keys.dtype
        else:
            # no attention at all: the pool keeps one token-sized placeholder layer, so the
            # block books (prefix hashes, budgets) work unchanged; nothing reads it
            self.num_kv_heads, self.head_dim, self.dtype = 1, 1, mx.float32
        slots: list[LayerSlot] = []
        counts = {"full": 0, "window": 0, "state": 0}
        for c in cache:
            kind = kinds_of(c)
            index = counts["state"] if kind == "state" else counts["full"] + counts["window"]
            counts[kind] += 1
            if kind == "state":
                state = tuple((tuple(a.shape[1:]), a.dtype) for a in c.cache)
                slots.append(LayerSlot(kind, index, state=state))
            else:
                slots.append(LayerSlot(kind, index, window=c.max_size if kind == "window" else None))
        self.layers = tuple(slots)
        self.num_layers = max(1, len(attention))
        self.num_state_layers = counts["state"]
        self.family = family

    @property
    def is_plain(self) -> bool:
        """Full attention in every layer: the paths built for that alone (compiled decode) apply."""
        return all(s.kind == "full" for s in self.layers)

    @property
    def has_state(self) -> bool:
        return self.num_state_layers > 0

    def describe(self) -> dict[str, Any]:
        kinds = [s.kind for s in self.layers]
        return {"family": self.family, "layers": {k: kinds.count(k) for k in ("full", "window", "state") if k in kinds},
                "windows": sorted({s.window for s in self.layers if s.window})}


def kinds_of(cache: Any) -> str:
    return PAGED_KINDS[type(cache).__name__]


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
    # several ranks (execute.tensor_parallel / pipeline_parallel): this rank's shard; the
    # geometry above is this rank's (its kv heads or its layers)
    world: Any = None  # distributed.World | None
    fused_groups: int = 0  # q/k/v and gate/up groups multiplied as one (fused.py)
    norm_blocks: int = 0  # blocks whose residual adds run with the norms after them (residual.py)
    decode_blocks: int = 0  # blocks whose decode steps of few rows run as four GEMV kernels (blocks.py)
    dense_mma_layers: int = 0  # bf16 linear layers whose steps of 5-64 rows take the tensor-core kernel
    kernel_embeddings: int = 0  # embeddings whose lookups are unikern's row kernel (cuda/rows.py)
    split_ropes: int = 0  # RoPE modules whose many-row steps launch in parts on CUDA (ropes.py)
    pitched_experts: int = 0  # expert projections whose sorted input is re-strided first (experts.py)
    # seconds per phase of load_model (stats.model.startup): build, fuse, read, geometry
    phases: dict[str, float] = field(default_factory=dict)


def load_model(name: str, world: Any = None, fuse: bool = False, fuse_quantized: bool = False,
               fuse_norms: bool = False, fuse_blocks: bool = False, dense_mma: bool = False,
               blocks_ops_rows: int | None = 0, block_kernel: bool = False,
               ahead: read_ahead.ReadAhead | None = None) -> LoadedModel:
    """Load with mlx-lm; with a world of several ranks, keep this rank's shard only
    (loaded lazily, so only the shard's weights are ever read). `fuse`: q/k/v and
    gate/up projections through one weight each (fused.py), quantized ones too if
    `fuse_quantized`. `fuse_norms`: each block's residual adds and the norms after them
    as one kernel (residual.py; one rank only). `fuse_blocks`: each block's decode steps of
    few rows as four GEMV kernels (blocks.py; one rank, needs `fuse`), and steps of up to
    `blocks_ops_rows` rows as the same steps through MLX's ops (None: blocks.AUTO_OPS_ROWS), and with
    `block_kernel` one-row steps as one kernel per block (cuda/block_kernel.py). `dense_mma`: plain
    bfloat16 linear layers' steps of 5-64 rows through unikern's tensor-core kernel
    (dense_mma.py; one rank). `ahead`: the weights the command line read while it imported
    (platform/read_ahead.py), taken instead of reading the files (one rank only)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from unikern.stages.execute.experts import route_experts

    path = resolve_model_path(name)
    sharded = world is not None and world.size > 1
    clock = PhaseClock()
    # lazily, always: the weights are read once, where they end up (a fused group's
    # concatenation reads its parts from the file; read first, each part was a second
    # resident copy until its group was built: 1 GB bf16 on the CPU machine, 3
    # alternations, 2.0-3.5 s and 1.84 GB peak RSS against 1.0-2.0 s and 1.49 GB)
    with read_ahead.serving(None if sharded else ahead, path) as taken:
        model, config = mlx_lm_load_model(path, lazy=True)
    clock.mark("build_s")
    family = str(config.get("model_type", path.name))
    if sharded:
        from unikern.stages.execute.sharding import (
            refuse_unpaged_kinds,
            shard_tensor_parallel,
            split_layers,
        )

        refuse_unpaged_kinds(model, family, world.mode)
        if world.mode == "tensor":
            shard_tensor_parallel(model, config, world.group, family)
        else:
            split_layers(model, world.group, family)
    # the embeddings' lookups by unikern's row kernel on CUDA, not MLX's run-time compiled gather
    kernel_embeddings = route_embeddings(model) if paged_cache.uses_row_kernel() else 0
    # small heads' decode-step RoPE in launches MLX's CUDA kernel takes
    split_ropes = route_ropes(model) if cuda_is_default() else 0
    # experts' sorted inputs with the row pitch MLX's CUDA grouped GEMM reads (every backend)
    pitched_experts = route_experts(model)
    fused_groups = 0
    if fuse:
        from unikern.stages.execute.fused import fuse_projections

        fused_groups = fuse_projections(model, quantized=fuse_quantized)
    clock.mark("fuse_s")
    norm_blocks = 0
    if fuse_norms and not sharded:
        from unikern.stages.execute.residual import fuse_residual_norms

        norm_blocks = fuse_residual_norms(model)
    decode_blocks = 0
    if fuse_blocks and fused_groups and not sharded:
        from unikern.stages.execute.blocks import fuse_decode_blocks

        decode_blocks = fuse_decode_blocks(model, ops_rows=blocks_ops_rows, one_kernel=block_kernel)
    dense_mma_layers = 0
    if dense_mma and not sharded:
        from unikern.stages.execute.dense_mma import route_dense_layers

        dense_mma_layers = route_dense_layers(model)
    clock.mark("blocks_s")  # fused norms and blocks, tensor-core routing (their kernels' state)
    weights = [w for _, w in tree_flatten(model.parameters())]
    mx.eval(weights)
    clock.mark("read_s")  # the weights not read by a fused group (all of them unfused)
    geometry = ModelGeometry(model, family)  # a first forward: the device's first kernels
    clock.mark("geometry_s")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(str(geometry.dtype).encode())
    digest.update(b"fused" if fused_groups else b"")  # other rounding: its own cached KV
    digest.update(b"norms" if norm_blocks else b"")
    digest.update(b"blocks" if decode_blocks else b"")
    digest.update(b"dense_mma" if dense_mma_layers else b"")
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
        world=world if sharded else None,
        fused_groups=fused_groups,
        norm_blocks=norm_blocks,
        decode_blocks=decode_blocks,
        dense_mma_layers=dense_mma_layers,
        kernel_embeddings=kernel_embeddings,
        split_ropes=split_ropes,
        pitched_experts=pitched_experts,
        phases={**clock.phases, **taken},
    )
