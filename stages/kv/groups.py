"""Layer groups of the KV pool. A model that mixes full and windowed attention layers
(gemma3, gpt-oss, cohere2) keeps its windowed layers in a pool of their own, with books
(a block id space) of their own: a sequence's windowed table holds only the blocks its
window reaches, its full table every block. One group (every other model, or
`layer_groups: shared`) is the pool as it always was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from unikern.errors import ConfigError

if TYPE_CHECKING:
    from unikern.stages.execute.model import ModelGeometry

# sequences whose windows the window group has room for by default (schedule.max_num_seqs' default)
DEFAULT_WINDOW_SEQS = 64


@dataclass(frozen=True)
class GroupPlan:
    """How the KV budget is split: `num_layers` / `num_blocks` of the full group (all
    attention layers when there is one group) and of the window group (0 when none)."""

    num_layers: int
    num_blocks: int
    bytes_per_block: int
    window: int | None = None  # the window group's widest window; None: one group
    window_layers: int = 0
    window_num_blocks: int = 0
    window_bytes_per_block: int = 0


def plan_groups(
    geometry: ModelGeometry, budget_bytes: int, block_size: int, layer_groups: str, window_blocks: int | None
) -> GroupPlan:
    """Split the budget: the window group gets `window_blocks` blocks (default: room for
    DEFAULT_WINDOW_SEQS sequences' windows plus a block each, never more than one shared
    pool would give it), the full group the rest."""
    per_layer = 2 * block_size * geometry.num_kv_heads * geometry.head_dim * geometry.dtype.size
    kinds = [s.kind for s in geometry.layers]
    windows = [s.window for s in geometry.layers if s.kind == "window"]
    n_full, n_window = kinds.count("full"), kinds.count("window")
    if layer_groups == "shared" or not (n_full and n_window):
        bpb = geometry.num_layers * per_layer
        return GroupPlan(geometry.num_layers, budget_bytes // bpb, bpb)
    window = max(windows)
    shared_blocks = budget_bytes // ((n_full + n_window) * per_layer)
    if window_blocks is None:
        window_blocks = DEFAULT_WINDOW_SEQS * (-(-window // block_size) + 2)
    window_blocks = min(window_blocks, shared_blocks)
    full_blocks = (budget_bytes - window_blocks * n_window * per_layer) // (n_full * per_layer)
    if window_blocks < 1 or full_blocks < 1:
        raise ConfigError(
            f"kv: the KV budget of {budget_bytes} bytes cannot hold a {block_size}-token block in both "
            f"layer groups ({n_full} full layers: {full_blocks} blocks, {n_window} windowed: {window_blocks}); "
            f"raise kv.memory_fraction or kv.kv_budget_bytes, or set kv.window_blocks"
        )
    return GroupPlan(n_full, full_blocks, n_full * per_layer, window, n_window, window_blocks, n_window * per_layer)
