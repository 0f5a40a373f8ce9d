"""Decode attention read straight from the paged pool (execute.paged_attention).

A decode step of several rows used to gather every row's keys and values out of the pool
into a dense [B, H, L, D] copy per layer and run a masked SDPA over it; an array mask
keeps MLX's CUDA SDPA off its fused decode kernel. Here one kernel per layer walks each
row's slot table in the pool, with the row's length instead of a mask: no gathered copy,
no mask, and fixed shapes, so a one-row window can be a traced (`mx.compile`d) step too.

On CUDA the kernel is written with `mx.fast.cuda_kernel`: one thread block per (row,
KV head) (paged_group.cu; or per row and query head, paged_head.cu: `KERNEL`), each warp
taking every NW-th position with an online softmax in float32, the warps merged at the
end; a long row at few rows is split over several blocks and merged by a second kernel
(`partitions`, paged_merge.cu). (A version with a lane per position for q.k, one
warp-wide max and sum per 32 positions, measured slower on an H200: 248 against 220 us
per token over the 16 layers of the 1B shape at one row, 990 against 744 at 64 rows;
tools/probe/probe_cuda.py.) Elsewhere (and for head sizes the kernel does not take)
`reference` computes the same thing with MLX's own ops; the CPU tests run the routing
through it, run the kernels' CUDA source in a thread-per-lane emulation
(tests/cuda_emulation.py), and a GPU test holds the kernels to it."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, float_bits
from unikern.stages.execute.cuda import sources

WARPS = 8  # per block: positions are dealt round-robin to the warps
# With fewer blocks than this (a one-row step has one per KV head: 8 of an H200's 132
# SMs busy), the group kernel's blocks take FEW_BLOCKS_WARPS warps where their partials
# fit in shared memory: more positions in flight per block. A one-row token of the 1B
# shape on an H200 (CUPTI, 16 layers, tools/probe/probe_cuda.py): 170 us with 16 warps, 210
# with 8; the kernel before the slot prefetch (paged_group.cu) took 227. The 8B shape's
# 32 layers: 376 us, 578 before.
FEW_BLOCKS = 128
FEW_BLOCKS_WARPS = 16

# A block still walks its share of a row's positions alone, so with few blocks one row's
# time grows with its context: at 4,000 positions the unsplit kernel took 211 us per
# layer of the 1B shape on an H200, where mlx-lm's attention took 12 (one row,
# tools/probe/probe_cuda.py --prompt 4000). So where few blocks would run and the slot table is
# long, the group kernel splits each row's positions over P blocks (`partitions`), each
# writing its unnormalized partial softmax (its sum of exp-weighted values, its max and
# its sum of weights) in float32, and a second kernel merges a row's P partials per query
# head (flash-decoding). On an H200, one row of the 1B shape at a 4,000-token prompt:
# attention 3.37 ms per token unsplit, 0.78-0.89 ms split (16 blocks per KV head), the
# token 4.53 -> 1.93 ms against mlx-lm's 3.78; 16 rows at 1,000 tokens (2 blocks each):
# 1.88 -> 1.21 ms per step. Aiming at 512 or 1,024 blocks gave 0.75 and 0.70 ms, the
# merge growing as the partial kernel shrank: within 3% of the token's GPU time
# (tools/probe/probe_cuda.py).
SPLIT_BLOCKS = 256  # aim: about this many blocks of the partial kernel
SPLIT_MIN_POSITIONS = 256  # table positions per partition at least: shorter rows stay whole

# Positions whose keys and values a warp of the group kernel loads before using any: its
# loads in flight (the partial kernel at one block per SM looks bound by their latency,
# inferred from its 44-48 us per layer for 8 MB on an H200). 2 is measured; 4 and 8 are
# written for the next measurement (tools/probe/probe_cuda.py's engine-paged-u4 and -u8).
POSITIONS_IN_FLIGHT = 2

# The group kernel against the head kernel on an H200 at the 1B shape (8 KV heads of 4
# query heads each): 227 / 587 / 598 us per step at 1 / 16 / 64 rows against 238 / 703 /
# 616 (CUPTI, tools/probe/probe_cuda.py's engine-paged-group and -head). The default (KERNEL).
_HEAD_SOURCE = sources.text("paged_head.cu")
_GROUP = sources.text("paged_group.cu")
GROUP_SOURCE = sources.fill(_GROUP, STORE=sources.text("paged_group_out.cu"))
GROUP_PARTS_SOURCE = sources.fill(_GROUP, STORE=sources.text("paged_group_parts.cu"))
MERGE_SOURCE = sources.text("paged_merge.cu")

# which kernel decode() runs: "group" or "head" (a block per row and query head; tests and
# tools/probe/probe_cuda.py set it to compare the two)
KERNEL = "group"
GROUP_SHARED_BYTES = 32 << 10  # the group kernel's per-warp partials live in shared memory


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Shapes the kernel takes: 32 lanes x head_dim/32 elements, whole query groups."""
    return head_dim % 32 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0


def reference(q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, lengths: mx.array,
              scale: float) -> mx.array:
    """The same attention with MLX's ops: gather, mask by length, SDPA.
    q [B, H, 1, D]; pool_k/pool_v [Hk, S, D]; slots [B, L] int32; lengths [B] int32."""
    k = pool_k[:, slots].transpose(1, 0, 2, 3)  # [B, Hk, L, D]
    v = pool_v[:, slots].transpose(1, 0, 2, 3)
    mask = mx.arange(slots.shape[1])[None] < lengths[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None, None, :])


def partitions(B: int, Hk: int, L: int) -> int:
    """Blocks the group kernel splits each (row, KV head) over, for B rows of a slot
    table L positions wide: up to SPLIT_BLOCKS blocks in all, SPLIT_MIN_POSITIONS table
    positions each at least; 1 (no split) for short tables and full batches."""
    return max(1, min(SPLIT_BLOCKS // (B * Hk), L // SPLIT_MIN_POSITIONS))


def launch(B: int, H: int, Hk: int, D: int, P: int = 1) -> tuple[str, str, dict[str, int], int]:
    """The kernel KERNEL selects for these shapes (the group kernel where its partials fit
    in shared memory): its name, source, integer template parameters (NW: warps per
    block) and block count. P > 1 (the group kernel only): the split's partial kernel,
    P blocks per (row, KV head), whose output `merge_launch`'s kernel reduces."""
    constants = {"D": D, "E": D // 32, "H": H, "HK": Hk, "NW": WARPS}
    if not uses_group_kernel(H, Hk, D):
        assert P == 1, "only the group kernel splits a row's positions"
        return "head", _HEAD_SOURCE, constants, B * H
    group = H // Hk
    if B * Hk * P < FEW_BLOCKS and FEW_BLOCKS_WARPS * group * D * 4 <= GROUP_SHARED_BYTES:
        constants["NW"] = FEW_BLOCKS_WARPS
    constants["U"] = POSITIONS_IN_FLIGHT
    if P > 1:
        return "group_parts", GROUP_PARTS_SOURCE, {**constants, "G": group}, B * Hk * P
    return "group", GROUP_SOURCE, {**constants, "G": group}, B * Hk


def merge_launch(B: int, H: int, Hk: int, D: int) -> tuple[str, dict[str, int], int, int]:
    """The split's merge (it reads P from its input's shape): its source, template
    parameters, block count and threads per block (a warp per row and query head)."""
    return MERGE_SOURCE, {"D": D, "E": D // 32, "H": H, "HK": Hk, "G": H // Hk}, B * H, 32


def uses_group_kernel(H: int, Hk: int, D: int) -> bool:
    """KERNEL is the group kernel and its per-warp partials fit in shared memory."""
    return KERNEL == "group" and WARPS * (H // Hk) * D * 4 <= GROUP_SHARED_BYTES


def decode(q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, lengths: mx.array,
           scale: float, use_kernel: bool, after: mx.array | None = None) -> mx.array:
    """Attention of one query per row over positions [0, lengths[b]) of its slot table;
    `after`: an array the kernel takes and does not read (pool_write.write's), so it runs
    after the kernel that made it."""
    B, H, T, D = q.shape
    Hk = pool_k.shape[0]
    if not use_kernel or T != 1 or not supports(D, H, Hk) or pool_k.dtype != q.dtype:
        if after is not None:
            raise ValueError("the pool written in place is read back by the attention kernel only (`after`)")
        return reference(q, pool_k, pool_v, slots, lengths, scale)
    P = partitions(B, Hk, slots.shape[1]) if uses_group_kernel(H, Hk, D) else 1
    name, source, constants, blocks = launch(B, H, Hk, D, P)
    # `after` only where given: the kernel built as ever otherwise (the signature is in its name)
    names = ("q", "k_pool", "v_pool", "slots", "lengths") + (("after",) if after is not None else ())
    kernel = cuda_kernel(f"unikern_paged_decode_{name}", names, source)
    (out,) = kernel(
        inputs=[q, pool_k, pool_v, slots.astype(mx.int32), lengths.astype(mx.int32),
                *([after] if after is not None else [])],
        template=[("T", q.dtype), *constants.items(), ("SCALE", float_bits(scale))],
        grid=(blocks * constants["NW"] * 32, 1, 1),
        threadgroup=(constants["NW"] * 32, 1, 1),
        output_shapes=[(B, H, 1, D) if P == 1 else (blocks, H // Hk, D + 2)],
        output_dtypes=[q.dtype if P == 1 else mx.float32],
    )
    if P == 1:
        return out
    source, constants, blocks, threads = merge_launch(B, H, Hk, D)
    merge = cuda_kernel("unikern_paged_decode_merge", ("parts",), source)
    (out,) = merge(inputs=[out], template=[("T", q.dtype), *constants.items()], grid=(blocks * threads, 1, 1),
                   threadgroup=(threads, 1, 1), output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype])
    return out
