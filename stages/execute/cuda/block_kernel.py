"""A decoder block's one-row decode step as one CUDA kernel (execute.block_kernel;
block_step.cu).

At one stream the host paces a token, not the GPU: a 1B token on an H200 ran 99 kernels,
5 per block (blocks.py), and MLX spent 0.89-1.56 ms encoding them plus 0.32-0.53 ms
replaying the traced step, against 0.97 ms of GPU time (tools/probe/step_gaps.py); llama.cpp's
token took 1.2 ms (tools/bench/bench_gpu.py). Here the block's five steps run in one kernel
whose phases meet at grid-wide barriers:

  0. RMS norm -> q/k/v GEMV -> RoPE on q and k; k and v into the pool at the row's slot
  1. the decode attention over the row's slot table (paged_attention's group kernel:
     one block per KV head, or with ATTN_SPLIT several, merged by the last done)
  2. output GEMV -> + residual                 -> h
  3. RMS norm -> gate/up GEMV -> SwiGLU         -> a
  4. down GEMV -> + residual                    -> the block's output

A grid of one block per SM (grid_blocks(), so all are resident at once: a
barrier's waiting blocks cannot hold back one not yet started) walks each phase's
output pairs in turn; a phase's blocks stage its input row in shared memory (normalized,
the row's sum of squares summed by the block itself), and each warp (or SPLIT warps) gives
one output pair as block_gemv's kernel does, rounding as MLX's ops round. The barrier is a
count in device memory: the block's first thread arrives with a fence and one atomic add
(block 0 adds 2^31 minus the other blocks, the others 1, so a full round flips the
count's top bit: FLIP_BARRIER; or a count and a generation, the last to arrive resetting
the one and advancing the other) and spins until the round is done (at most SPIN_LIMIT
polls, then it goes on and marks `bar[2]`, so a grid that could not all be resident
gives wrong numbers, which the tests see, instead of a hung GPU). The kernel's
intermediate rows are outputs of their own (q, the attention, h, a, the split
attention's partials): written in one phase, read in the next, never read before they
are written, so no block can hold a stale copy in its cache.

Phases FIRST..LAST run in one launch; the tests' emulation (tests/cuda_emulation.py),
which runs blocks one after another, runs one phase per launch with the rows carried
over. One row, unquantized blocks (blocks.py's BlockPlan), a slot table the group kernel
takes whole (paged_attention.partitions 1; any with ATTN_SPLIT) and shared memory within
48 KB; other steps keep the five kernels.

Measured on an H200 (1B shape, one row; tools/probe/probe_cuda.py's engine-paged-blocks-one
against engine-paged-blocks): a token 34 kernels instead of 99, the runner's token
1.08-1.15 ms against 1.33-1.34 (host: the traced step's replay 0.11-0.19 ms and
mx.async_eval 0.38-0.48, against 0.39 and 0.93), the same 64 tokens; the 16 block kernels
take 948 us of GPU time with UNROLL 4 (59 us a block for its 122 MB of weights, 2.1
TB/s), 981 with 2, against 0.96-0.99 ms for the whole token before. The engine at one
request: 769 against 455 tok/s (one-process A/B, 6 of 6; tools/bench/bench_ab.py). The phases
timed from the GPU's clock (TIMES; tools/probe/probe_block_phases.py): of a 57.7 us block,
gate/up 20.4 us (3.3 TB/s), down 13.3, q/k/v 10.8, the attention 7.5, o 5.7, each
barrier 1.7-2.0; with the input rows staged in 16-byte chunks and the one-atomic barrier,
47.1 us."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform import cuda_sm_count
from unikern.platform.kernel_cache import cuda_kernel, float_bits, off_small_pool, placeholder
from unikern.stages.execute.cuda import block_gemv, paged_attention, sources
from unikern.stages.execute.cuda.block_gemv import ITEMSIZE

# block_gemv's loads and the GPU's nanosecond clock (for TIMES); for the tests' emulation,
# their C++ stand-ins
HEADER = block_gemv.HEADER + sources.text("clock.cuh")
EMULATED_HEADER = block_gemv.EMULATED_HEADER + sources.text("clock_emulation.h")

# blocks of the grid: one per SM of the device (platform.cuda_sm_count; 132 on an H100 or
# H200), so all are resident at once (a block's registers and shared memory fit one SM of
# sm_80 and later); None: ask the driver, and where it cannot say the kernel is not used
GRID_BLOCKS: int | None = None
WARPS = 16  # per block (the attention phase's warps too: FEW_BLOCKS_WARPS)
UNROLL = 4  # 16-byte chunks per lane in flight per weight row (2: 981 against 948 us a 1B token)
MIN_CHUNKS = 32  # of a weight row per warp at least (one per lane) when a pair is split
# warps per output pair of the four GEMV phases (q/k/v, o, gate/up, down) forced (tests,
# probes); None: split_for's choice
SPLITS: tuple[int, int, int, int] | None = None
SPIN_LIMIT = 1 << 24  # polls of the barrier's generation before a block gives up on it
SPIN_SLEEP_NS = 32  # a waiting block's pause between polls (0: none)
# the barrier as one atomic a block (1): block 0 adds 2^31 - (blocks - 1), the others 1, so
# a round's sum flips the count's top bit and leaves its low bits as they were; each block
# waits for the flip (cooperative groups' grid sync does the same). 0: the count and a
# generation, the last to arrive resetting the one and advancing the other (two more
# atomics on the barrier's path). On an H200, 1B block, 16 chained: the kernel 46.0 us
# against 47.9, and 47.1 against 49.5 in another machine start
# (tools/probe/probe_block_phases.py)
FLIP_BARRIER = 1
SHARED_BYTES = 48 << 10  # static shared memory a kernel may declare
PHASES = 5
# the attention phase split over several blocks per KV head, ATTN_MIN_POSITIONS each at least
# (1), instead of one block per KV head while the others wait at the barrier (0). A 1B
# token on an H200, one row at 64-128 positions: GPU 1.025 ms against 1.046, 1.070 ms per
# step against 1.097-1.103 (tools/probe/probe_cuda.py's engine-paged-blocks-one-split); it also
# takes tables of 512 positions and more, which one block per KV head does not
ATTN_SPLIT = 1
ATTN_MIN_POSITIONS = 16
# each warp's first weight loads of a phase issued before the barrier (or the norm) the
# phase waits on (1), so each phase's start does not wait a full memory latency: measured
# no faster on an H200 (GPU 1.048 ms a 1B token against 1.046; with the split 1.039
# against 1.025; tools/probe/probe_cuda.py's engine-paged-blocks-one-preload).
# Only where the block's threads' registers fit an SM's 65,536: with it a thread takes
# these many (NVRTC, sm_90), by itemsize (float32: 16 warps do not fit)
PRELOAD = 0
PRELOAD_REGISTERS = {2: 127, 4: 136}
# each block's clock (the GPU's globaltimer, ns, its low 32 bits) in the output `times`:
# at its start, then per phase once its input row is staged, as its work ends and as it
# leaves the barrier after it (tools/probe/probe_block_phases.py reads them); off in the engine
TIMES = 0

# The attention phase: paged_attention's group kernel for one row, its blocks walked by the
# grid ("vb"): one per KV head writing `att`, or (ATTN_SPLIT, `nparts` > 1) each KV head's
# positions split over nparts blocks writing their partial softmaxes to `parts`, the last
# of a KV head's blocks to finish (its counter in `bar`) merging them into `att`, as
# paged_attention's split and merge kernels do: their texts with these names renamed.
def _without_last_brace(text: str) -> str:
    head, _, tail = text.rpartition("}")
    assert not tail.strip(), "the group kernel's endings close its loop over the heads"
    return head


SOURCE = sources.fill(
    sources.text("block_step.cu"),
    GROUP=sources.renamed(sources.fill(sources.text("paged_group.cu"), STORE=""),
                          ("blockIdx.x", "vb"), ("gridDim.x", "(HK * nparts)"), ("q[row + e]", "qs[row + e]")),
    GROUP_OUT=_without_last_brace(sources.renamed(sources.text("paged_group_out.cu"), ("out[row + e]", "att[row + e]"))),
    GROUP_PARTS=_without_last_brace(sources.renamed(sources.text("paged_group_parts.cu"), ("out[at", "parts[at"))),
    MERGE=sources.renamed(sources.text("paged_merge.cu"), ("blockIdx.x", "kvh * G + g"),
                          ("threadIdx.x", "threadIdx.x % 32"), ("parts_shape[0] / (gridDim.x / H * HK)", "nparts"),
                          ("out[", "att[")))
INPUTS = ("x", "w_qkv", "b_qkv", "n1", "w_o", "n2", "w_gu", "w_down", "pos", "freq_pi", "k_pool", "v_pool",
          "wslot", "slots", "lengths", "bar")
OUTPUTS = ("out", "qs", "att", "h", "a", "parts", "times")


def split_for(K: int, pairs: int, itemsize: int, grid: int, warps: int) -> int:
    """Warps per output pair for a phase of `pairs` pairs over rows of K: the split whose
    warps wait on memory the fewest times in a row (the phase's rounds of the grid times
    the passes of UNROLL loads per lane a warp's share of a row takes), then the one that
    leaves the fewest blocks idle (ties: the smaller), each warp keeping at least
    MIN_CHUNKS of its row's 16-byte chunks. A 1B block on an H200
    (tools/probe/probe_block_phases.py): q/k/v over 4 warps a pair took 3 rounds of one pass,
    its work done 6.8-9.0 us into the kernel; over 1 warp (1 round of 2 passes) 3.1-7.6
    us, the kernel 56.1 us against 57.7."""
    chunks, best, best_key = K * itemsize // 16, 1, None
    split = 1
    while split <= warps:
        if split == 1 or chunks // split >= MIN_CHUNKS:
            turns = -(-pairs // (warps // split))  # block turns
            rounds = -(-turns // grid)
            per_warp = -(-chunks // split)  # of a row's chunks
            passes = rounds * -(-per_warp // (32 * UNROLL))
            key = (passes, rounds * grid - turns)
            if best_key is None or key < best_key:
                best, best_key = split, key
        split *= 2
    return best


def splits(width: int, inter: int, qn: int, kn: int, itemsize: int, grid: int, warps: int) -> tuple[int, ...]:
    """Warps per pair of the q/k/v, o, gate/up and down phases (SPLITS where forced)."""
    if SPLITS is not None:
        return SPLITS
    return (split_for(width, (qn + 2 * kn) // 2, itemsize, grid, warps), split_for(qn, width // 2, itemsize, grid, warps),
            split_for(width, inter, itemsize, grid, warps), split_for(inter, width // 2, itemsize, grid, warps))


def shared_bytes(width: int, inter: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The kernel's static shared memory: the staged row, the attention's per-warp partials."""
    group, warps = heads // kv_heads, WARPS
    return (max(width, inter, heads * head_dim) * itemsize + warps * group * (head_dim + 2) * 4
            + warps * 12)


def grid_blocks() -> int | None:
    """The grid's blocks: GRID_BLOCKS, or the device's SMs where it is None."""
    return GRID_BLOCKS or cuda_sm_count()


def fits(width: int, inter: int, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, table: int) -> bool:
    """Whether a one-row step of these shapes takes the kernel: 16-byte loads along every
    weight row, head sizes the attention takes, a slot table `table` wide that one block
    per KV head takes whole (paged_attention's kernel would not split it) or any with
    ATTN_SPLIT, the shared memory within SHARED_BYTES, a grid size known (grid_blocks)."""
    if dtype not in ITEMSIZE or not grid_blocks():
        return False
    pack = 16 // ITEMSIZE[dtype]
    return (width % pack == 0 and inter % pack == 0 and (heads * head_dim) % pack == 0 and width % 2 == 0
            and paged_attention.supports(head_dim, heads, kv_heads)
            and (ATTN_SPLIT or paged_attention.partitions(1, kv_heads, table) == 1)
            and shared_bytes(width, inter, heads, kv_heads, head_dim, ITEMSIZE[dtype]) <= SHARED_BYTES)


def barrier(kv_heads: int) -> mx.array:
    """A zero barrier for the kernel (count, generation, the spin-out mark, then a
    counter per KV head for the split attention's merge), in device memory
    (kernel_cache.SMALL_POOL_BYTES)."""
    return mx.zeros((off_small_pool(3 + kv_heads, 4),), dtype=mx.uint32)


def block_step(x: mx.array, w_qkv: mx.array, b_qkv: mx.array | None, norm1: tuple[mx.array, float], w_o: mx.array,
               norm2: tuple[mx.array, float], w_gu: mx.array, w_down: mx.array, pos: mx.array, freq_pi: mx.array,
               heads: int, kv_heads: int, head_dim: int, traditional: bool, scale: float,
               pool: tuple[mx.array, mx.array, mx.array], slots: mx.array, lengths: mx.array, bar: mx.array,
               phases: tuple[int, int] = (0, PHASES - 1)) -> list[mx.array]:
    """One row x [1, ..., width] through a decoder block (see the module's notes): its
    outputs [out (x's shape), q, the attention, h, a]. w_qkv [(heads + 2 kv_heads) *
    head_dim, width] with its bias or None, norm1 and norm2 (weight, eps) before the q/k/v
    and gate/up GEMVs, w_gu [2 * inter, width] (gate's rows, then up's), w_down [width,
    inter]; pos: the row's position (int32 [1]); freq_pi: RoPE's inverse frequencies over
    pi; pool: the layer's pool arrays [kv heads, slots, head_dim] and the row's slot (k and
    v go there in place); slots [1, L] and lengths [1]: the row's slot table and length
    for the attention; bar: `barrier(kv_heads)`, kept for the call site; `phases`: the first and
    last phase to run. The grid: grid_blocks() blocks of WARPS warps."""
    width = w_qkv.shape[1]
    inter = w_down.shape[1]
    if x.size != width or w_gu.shape != (2 * inter, width) or w_o.shape != (width, heads * head_dim):
        raise ValueError(f"the block kernel takes one row of {width} and a block's weights: x {x.shape}, "
                         f"o {w_o.shape}, gate/up {w_gu.shape}, down {w_down.shape}")
    k_pool, v_pool, wslot = pool
    itemsize, grid, warps = ITEMSIZE[x.dtype], grid_blocks(), WARPS
    if not grid:
        raise RuntimeError("the block kernel's grid is one block per SM, and the CUDA driver did not say how many "
                           "SMs the device has: set block_kernel.GRID_BLOCKS, or execute.block_kernel: never")
    qn, kn = heads * head_dim, kv_heads * head_dim
    template = [("T", x.dtype), ("WIDTH", width), ("INTER", inter), ("QN", qn), ("KN", kn), ("NQKV", qn + 2 * kn),
                ("XMAX", max(width, inter, qn)), ("WARPS", warps), ("UW", UNROLL),
                *zip(("SA", "SC", "SD", "SE"), splits(width, inter, qn, kn, itemsize, grid, warps), strict=True),
                ("BIAS", int(b_qkv is not None)), ("TRAD", int(traditional)),
                ("EPS1", float_bits(norm1[1])), ("EPS2", float_bits(norm2[1])),
                # the attention phase (paged_attention's group kernel)
                ("D", head_dim), ("E", head_dim // 32), ("H", heads), ("HK", kv_heads), ("G", heads // kv_heads),
                ("NW", warps), ("U", paged_attention.POSITIONS_IN_FLIGHT), ("SCALE", float_bits(scale)),
                ("FIRST", phases[0]), ("LAST", phases[1]), ("SPIN_LIMIT", SPIN_LIMIT), ("SPIN_SLEEP", SPIN_SLEEP_NS), ("FLIP", FLIP_BARRIER),
                ("ATTN_SPLIT", ATTN_SPLIT), ("ATTN_MIN", ATTN_MIN_POSITIONS), ("PRELOAD", int(PRELOAD and PRELOAD_REGISTERS[itemsize] * warps * 32 <= 65536)),
                ("PHASES", PHASES), ("TIMES", TIMES)]
    inputs = [x, w_qkv, b_qkv if b_qkv is not None else placeholder(x.dtype), norm1[0], w_o, norm2[0], w_gu, w_down,
              pos, freq_pi, k_pool, v_pool, wslot, slots, lengths, bar]
    kernel = cuda_kernel("unikern_block_step", INPUTS, SOURCE, HEADER, OUTPUTS)
    return kernel(inputs=inputs, template=template, grid=(grid * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                  output_shapes=[x.shape, (1, heads, 1, head_dim), (1, heads, 1, head_dim), (1, width), (1, inter),
                                 (max(1, grid // kv_heads) * heads * (head_dim + 2) if ATTN_SPLIT else 1,),
                                 (grid * (1 + 3 * PHASES) if TIMES else 1,)],
                  output_dtypes=[x.dtype] * 5 + [mx.float32, mx.uint32])
