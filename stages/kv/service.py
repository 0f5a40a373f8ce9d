"""kv_manager: the KV service. Owns the paged pool and its books and lends them (the `kv`
resource) to schedule, execute and the mover; gives memory back once nothing runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from unikern.errors import ConfigError
from unikern.platform import current_platform
from unikern.stage import ServiceBase, StageContext, StageParams
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.kv.groups import GroupPlan, plan_groups
from unikern.stages.kv.pool import KVPool
from unikern.stages.kv.state_pool import StatePool

MiB = 1 << 20
RESERVED_BLOCKS = 2  # block 0: always zero (padded reads); block 1: scratch (padded writes)


class KVManagerParams(StageParams, frozen=True):
    block_size: int = 256
    """Tokens per logical block (a multiple of `kernel_block_size`): the unit of prefix caching,
    offload and disk files. Past a hit's last whole block, `partial_prefix` reuses the next
    block's leading kernel blocks where it can; families it does not cover (recurrent states,
    sliding windows) compute that part again, and gain from smaller blocks, at the price of
    more files in the disk tier and, in hybrid models, a recurrent state checkpoint per block."""
    kernel_block_size: int = 16
    """Tokens per kernel block (>= 1): what attention gathers, and the unit sequence lengths are
    padded to in a batch."""
    partial_prefix: bool = True
    """On a prefix hit, also reuse the longest cached leading part of the next logical block, in
    whole kernel blocks, by copying those slots into the prompt's own block (the cached block is
    shared, its later slots hold other tokens). A sequence that ends inside a block leaves that
    block's written units to such copies too (a conversation's next turn). Models with full
    attention only; the others reuse whole blocks."""
    memory_fraction: float = 0.5
    """The KV budget as a fraction (0 to 1] of the platform's total memory (no more than MLX's
    memory limit, `mx.set_memory_limit`), less the weights and `activation_reserve_bytes`.
    Ignored when `kv_budget_bytes` is set."""
    kv_budget_bytes: int | None = None
    """The KV budget in bytes (> 0), instead of `memory_fraction`; null: from `memory_fraction`."""
    activation_reserve_bytes: int = 512 * MiB
    """Bytes kept out of the budget for the model's activations when it comes from `memory_fraction`."""
    allocation: Literal["lazy", "eager"] = "lazy"
    """`lazy`: memory is taken as blocks are first written and given back when idle; `eager`: the whole
    budget is committed at start (for comparison)."""
    slab_bytes: int = 64 * MiB
    """On Metal and CUDA, the unit (bytes, > 0) of a lazy pool's size, which grows and shrinks
    through power-of-two counts of it; the CPU pool commits pages as they are written instead."""
    idle_trim_seconds: float = 2.0
    """Seconds (>= 0) with no block in use and nothing written, after which the memory of blocks that
    no prefix-cache entry names is given back."""
    idle_drop_cache_seconds: float | None = 300.0
    """Seconds idle (>= 0) after which the prefix cache is forgotten too and its memory given back;
    null: keep it, bounded by the budget."""
    unwritten_fill: Literal["zeros", "nan"] = "zeros"
    """What never-written slots hold: `zeros`, or `nan` for tests that prove masking (commits the
    whole pool)."""
    host_bytes: int = 0
    """Bytes (>= 0) of a host tier: cached blocks pushed out of the KV budget move there by accounting
    (on unified memory it is the same RAM) and come back on a prefix hit; 0: none."""
    state_checkpoints: int | None = None
    """Recurrent models (Mamba, gated delta nets): slots (>= 1) for state checkpoints at block
    boundaries, what a prefix hit restores; each costs one request's state in every recurrent layer.
    null: max(64, 2 x `schedule.max_num_seqs`)."""
    layer_groups: Literal["auto", "shared"] = "auto"
    """Models mixing full and windowed attention layers. `auto`: the windowed layers get a pool and
    block tables of their own, holding only their window's blocks; `shared`: one table for every layer."""
    window_blocks: int | None = None
    """Blocks (>= 1) of the windowed layers' own pool (`layer_groups: auto`); the full layers get the
    rest of the budget. null: room for 64 sequences' windows."""

    def validate(self) -> list[str]:
        problems = []
        if self.block_size < 1 or self.kernel_block_size < 1:
            problems.append("block_size: block sizes must be >= 1")
        elif self.block_size % self.kernel_block_size:
            problems.append(
                f"block_size: {self.block_size} is not a whole multiple of kernel_block_size "
                f"{self.kernel_block_size} (e.g. 256 and 16)"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            problems.append(f"memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            problems.append(f"kv_budget_bytes: must be > 0, got {self.kv_budget_bytes}")
        if self.slab_bytes <= 0:
            problems.append(f"slab_bytes: must be > 0, got {self.slab_bytes}")
        if self.idle_trim_seconds < 0:
            problems.append(f"idle_trim_seconds: must be >= 0, got {self.idle_trim_seconds}")
        if self.idle_drop_cache_seconds is not None and self.idle_drop_cache_seconds < 0:
            problems.append(f"idle_drop_cache_seconds: must be >= 0 or null, got {self.idle_drop_cache_seconds}")
        if self.host_bytes < 0:
            problems.append(f"host_bytes: must be >= 0, got {self.host_bytes}")
        if self.window_blocks is not None and self.window_blocks < 1:
            problems.append(f"window_blocks: must be >= 1 or null, got {self.window_blocks}")
        if self.state_checkpoints is not None and self.state_checkpoints < 1:
            problems.append(f"state_checkpoints: must be >= 1 or null, got {self.state_checkpoints}")
        return problems


class IdleTrim:
    """When to give memory back: the pool must have been idle (no block in use, no step
    written) for `idle_seconds`: "free" gives back what no cache entry names; after
    `drop_cache_seconds` "all" forgets the prefix cache too. Each once per idle spell,
    and only after something was written."""

    def __init__(self, idle_seconds: float, drop_cache_seconds: float | None) -> None:
        self.idle_seconds = idle_seconds
        self.drop_cache_seconds = drop_cache_seconds
        self._uses = 0
        self._idle_since: float | None = None
        self._done: str | None = "all"  # nothing written yet: nothing to give back

    def decide(self, now: float, blocks_in_use: int, uses: int) -> str | None:
        """"free", "all" or None (nothing to do now), from the books and the pool's count
        of writing steps as seen at `now`."""
        if uses != self._uses:  # written since the last look: a new idle spell to come
            self._uses, self._done = uses, None
            self._idle_since = None
            return None
        if blocks_in_use:
            self._idle_since = None
            return None
        if self._idle_since is None:  # idle from the first look that finds it so
            self._idle_since = now
            return None
        idle = now - self._idle_since
        drop = self.drop_cache_seconds
        if self._done != "all" and drop is not None and idle >= max(drop, self.idle_seconds):
            self._done = "all"
        elif self._done is None and idle >= self.idle_seconds:
            self._done = "free"
        else:
            return None
        return self._done


@dataclass
class KVResource:
    """The `kv` resource: the pool (bytes) and the books (block manager); for recurrent
    models also the state pool (request and checkpoint slots), which the execute stage
    runs on and the offload mover copies checkpoints out of and into."""

    pool: KVPool
    blocks: BlockManager
    budget_bytes: int
    state_checkpoints: int | None = None  # kv_manager's param, for the scheduler's state books
    # recurrent layers' slots and checkpoints (the runner's and the offload mover's); None: none
    states: StatePool | None = None
    # a mixed model's windowed layers, when they keep tables of their own (kv.groups)
    window_pool: KVPool | None = None
    window_blocks: BlockManager | None = None
    attention_kinds: tuple[str, ...] = ()  # "full" | "window" per attention layer, in model order

    def pools(self) -> list[tuple[KVPool, BlockManager]]:
        pools = [(self.pool, self.blocks)]
        if self.window_pool is not None:
            pools.append((self.window_pool, self.window_blocks))
        return pools


class KVManagerStage(ServiceBase):
    Params = KVManagerParams
    requires = ("model",)
    provides = ("kv",)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        p = self.params
        loaded = ctx.resource("model")
        geometry = loaded.geometry
        if p.kv_budget_bytes is not None:
            budget = p.kv_budget_bytes
        else:
            budget = current_platform().kv_budget_bytes(
                p.memory_fraction, loaded.weights_bytes, p.activation_reserve_bytes
            )
        plan = plan_groups(geometry, budget, p.block_size, p.layer_groups, p.window_blocks)
        bytes_per_block, num_blocks = plan.bytes_per_block, plan.num_blocks
        if num_blocks < 1:
            raise ConfigError(
                f"kv: the KV budget of {budget} bytes holds no {p.block_size}-token block "
                f"({bytes_per_block} bytes each); raise kv.memory_fraction or kv.kv_budget_bytes"
            )
        # split groups: a host block holds a logical block in both, as a shared pool's would
        host_blocks = p.host_bytes // (bytes_per_block + plan.window_bytes_per_block)

        def make_pool(num_layers: int, num_blocks: int, bytes_per_block: int) -> KVPool:
            return KVPool(
                num_layers=num_layers,
                num_kv_heads=geometry.num_kv_heads,
                head_dim=geometry.head_dim,
                dtype=geometry.dtype,
                block_size=p.block_size,
                kernel_block_size=p.kernel_block_size,
                num_blocks=num_blocks + RESERVED_BLOCKS,
                slab_blocks=max(1, p.slab_bytes // bytes_per_block),
                eager=p.allocation == "eager",
                fill_value=float("nan") if p.unwritten_fill == "nan" else 0.0,
            )

        started = time.perf_counter()
        pool = await loaded.thread.run(make_pool, plan.num_layers, num_blocks + host_blocks, bytes_per_block)
        namespace = loaded.identity + f"/bs{p.block_size}".encode()
        books = BlockManager(
            num_blocks, p.block_size, namespace, reserved_blocks=RESERVED_BLOCKS, host_blocks=host_blocks,
            partial_unit=p.kernel_block_size if p.partial_prefix else 0,
        )
        budget_used = num_blocks * bytes_per_block
        states = StatePool([s.state for s in geometry.layers if s.kind == "state"]) if geometry.has_state else None
        self.kv = KVResource(pool, books, budget_used, p.state_checkpoints, states)
        self.plan = plan
        if plan.window is not None:  # the window group: its own pool and id space
            self.kv.window_pool = await loaded.thread.run(
                make_pool, plan.window_layers, plan.window_num_blocks + host_blocks, plan.window_bytes_per_block
            )
            self.kv.window_blocks = BlockManager(
                plan.window_num_blocks, p.block_size, namespace + b"/window", reserved_blocks=RESERVED_BLOCKS,
                host_blocks=host_blocks,
            )
            self.kv.budget_bytes += plan.window_num_blocks * plan.window_bytes_per_block
            self.kv.attention_kinds = tuple(s.kind for s in geometry.layers if s.kind != "state")
        self.startup = {"pool_s": round(time.perf_counter() - started, 3)}  # (Engine.startup)
        ctx.provide("kv", self.kv)
        task_status.started()
        if p.allocation == "lazy":
            await self._trim_when_idle(loaded.thread)
        else:
            await anyio.sleep_forever()

    async def _trim_when_idle(self, thread) -> None:
        p, kv = self.params, self.kv
        trim = IdleTrim(p.idle_trim_seconds, p.idle_drop_cache_seconds)
        poll = max(0.01, min(p.idle_trim_seconds / 4, 0.5))
        while True:
            await anyio.sleep(poll)
            in_use = sum(books.num_used for _, books in kv.pools())
            what = trim.decide(anyio.current_time(), in_use, kv.pool.uses)
            if what is None:
                continue
            releases = []
            for pool, books in kv.pools():
                if what == "all":
                    books.evict_all_cached()
                releases.append((pool, set(books.hash_to_block.values())))
            # the books are idle now and thread.run queues the release (of every group's
            # pool at once: no await in between) before any step that could write a
            # block handed out from here on
            await thread.run(_release_pools, releases)

    def stats(self) -> dict[str, Any]:
        kv = getattr(self, "kv", None)
        if kv is None:
            return {}
        return {
            "memory": {"kv_budget_bytes": kv.budget_bytes,
                       "kv_resident_bytes": sum(pool.resident_bytes for pool, _ in kv.pools())},
            "kv": {
                "block_size": kv.blocks.block_size,
                "kernel_block_size": kv.pool.kernel_block_size,
                "blocks_total": kv.blocks.num_blocks,
                "blocks_used": kv.blocks.num_used,
                "blocks_cached": kv.blocks.num_cached,
                "blocks_allocated": kv.pool.committed_blocks(),
                "allocation": self.params.allocation,
                "releases": kv.pool.shrink_events,
                "released_bytes": kv.pool.released_bytes,
                "relocations": kv.pool.relocations,
                "groups": _group_stats(kv, self.plan),
            },
            "tiers": _tier_stats(kv),
        }


def _release_pools(releases: list[tuple[KVPool, set[int]]]) -> None:
    for pool, keep in releases:
        pool.release(keep)


def _group_stats(kv: KVResource, plan: GroupPlan) -> list[dict[str, Any]]:
    """Per layer group: the blocks_* figures above are the first (full) group's."""
    groups = [("full" if plan.window is not None else "all", plan.num_layers, None, kv.blocks)]
    if kv.window_blocks is not None:
        groups.append(("window", plan.window_layers, plan.window, kv.window_blocks))
    return [
        {"layers": name, "num_layers": n, "window": window, "blocks_total": books.num_blocks,
         "blocks_used": books.num_used, "blocks_cached": books.num_cached, "host_blocks": books.num_host_cached}
        for name, n, window, books in groups
    ]


def _tier_stats(kv: KVResource) -> dict[str, Any]:
    """Blocks, hits and misses: the full group's (every layer's with one group); bytes:
    every group's."""
    books = kv.blocks
    host_bytes = sum(b.num_host_cached * pool.bytes_per_block for pool, b in kv.pools())
    tiers: dict[str, Any] = {
        "device": {
            "blocks": books.num_used,
            # the pools' resident memory, less what the host tier holds (the same RAM)
            "bytes": max(0, sum(pool.resident_bytes for pool, _ in kv.pools()) - host_bytes),
            "hits": books.hits - books.host_hits,
            "misses": books.misses + books.host_hits,  # not on the device
            # prompts that copied the leading part of a cached block, and its tokens
            "partial_hits": books.partial_hits,
            "partial_hit_tokens": books.partial_hit_tokens,
            "kept_partial": books.kept_partial,  # ended sequences' unfilled last blocks kept for them
            "evictions": books.device_evictions,
        }
    }
    if books.host_blocks:
        tiers["host"] = {
            "blocks": books.num_host_cached,
            "bytes": host_bytes,
            "capacity_blocks": books.host_blocks,
            "hits": books.host_hits,
            "misses": books.host_misses,
            "evictions": books.host_evictions,
        }
    return tiers
