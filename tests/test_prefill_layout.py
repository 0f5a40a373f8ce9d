"""A prompt's prefill step: which pool reads and writes its layout asks for. A fresh
prompt attends to this forward's own keys, whatever its block table looks like; the
pool is read back only for keys an earlier step wrote (a prefix-cache hit, a chunk)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from unikern import messages as m
from unikern.stages.execute.layouts import BatchLayout
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.kv.pool import KVPool

SCATTERED = (9, 3, 7, 5)  # no run of consecutive ids: no slice path


def small_pool(num_blocks: int = 16, geo: ModelGeometry | None = None) -> KVPool:
    """A pool of 4-slot blocks: one layer of 2 KV heads of 8 (float32), or a model's."""
    shape = dict(num_layers=1, num_kv_heads=2, head_dim=8, dtype=mx.float32) if geo is None else dict(
        num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype)
    return KVPool(**shape, block_size=4, kernel_block_size=4, num_blocks=num_blocks, slab_blocks=num_blocks)


def test_a_fresh_prompt_reads_no_pool_whatever_its_table():
    pool = small_pool()
    layout = BatchLayout.build(pool, [(SCATTERED, 0, 13)])
    assert layout.span is None and layout.read_slots is None and layout.mask == "causal"
    assert layout.write_slots.tolist() == [b * 4 + i for b in SCATTERED for i in range(4)][:13]
    # a prompt after cached positions reads the earlier ones back
    later = BatchLayout.build(pool, [(SCATTERED, 5, 8)])
    assert later.read_slots is not None and later.read_slots.shape == (1, 13)


def pool_reads(runner: ModelRunner, table: tuple[int, ...], prompt: tuple[int, ...]) -> int:
    """Gathers in the prefill forward's graph (the pool read back per layer)."""
    import re
    import tempfile

    layout = BatchLayout.build(runner.pool, [(table, 0, len(prompt))])
    logits = runner.model(mx.array([prompt]), cache=runner._caches(layout))
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, logits)
        labels = re.findall(r'label ="([^"]+)"', f.read())
    mx.eval(logits, *runner._written())
    return sum(label == "Gather" for label in labels)


def test_a_fresh_prompt_on_a_scattered_table_decodes_as_on_consecutive_blocks(tiny_llama):
    model, _ = load(tiny_llama)
    geo = ModelGeometry(model)
    pool = small_pool(24, geo)
    runner = ModelRunner(model, pool)
    pool.ensure_capacity(24)
    prompt = tuple(range(5, 18))
    # the embedding's lookup is the one gather left: no layer reads the pool back
    assert pool_reads(runner, SCATTERED + (11,), prompt) == 1

    params = m.SamplingParams(max_tokens=8)

    def tokens(table: tuple[int, ...]) -> list[int]:
        out = runner.run(m.Step(1, (m.SeqWork("r", prompt, 0, table, True, params),), 1), {})["r"]
        for i in range(6):  # the decode steps read the keys the prefill wrote
            step = m.SeqWork("r", (out[-1],), len(prompt) + i, table, True, params, num_generated=len(out))
            out += runner.run(m.Step(2 + i, (step,), 1), {})["r"]
        return out

    assert tokens(SCATTERED + (11,)) == tokens((12, 13, 14, 15, 16))


@pytest.mark.parametrize("start", [0, 6])
def test_pool_holds_a_prompts_keys_after_its_prefill(start):
    """Written where the table says, read back (or not) as the layout says."""
    pool = small_pool()
    pool.ensure_capacity(16)
    from unikern.stages.execute.paged_cache import PagedLayerCache

    T = 7
    keys = mx.random.normal((1, 2, T, 8))
    values = keys + 1
    layout = BatchLayout.build(pool, [(SCATTERED, start, T)])
    k, v = PagedLayerCache(pool, 0, layout).update_and_fetch(keys, values)
    mx.eval(k, v, pool.keys, pool.values)
    slots = [b * 4 + i for b in SCATTERED for i in range(4)][start : start + T]
    assert mx.array_equal(pool.keys[0][:, mx.array(slots)], keys[0]).item()
    assert mx.array_equal(pool.values[0][:, mx.array(slots)], values[0]).item()
    assert k.shape[2] == (T if start == 0 else start + T)  # its own keys, or the table's
    assert mx.array_equal(k[:, :, -T:], keys).item()


def rows_runner(model_dir: str, prefill_rows: int, fuse_blocks: bool) -> ModelRunner:
    from unikern.stages.execute.model import load_model

    loaded = load_model(model_dir, fuse=fuse_blocks, fuse_blocks=fuse_blocks, blocks_ops_rows=None)
    geo = loaded.geometry
    pool = small_pool(40, geo)
    return ModelRunner(loaded.model, pool, geometry=geo, paged_attention=True, prefill_rows=prefill_rows)


def greedy(runner: ModelRunner, prompts: dict[str, tuple[int, ...]], tables: dict[str, tuple[int, ...]],
           start: int = 0, steps: int = 6) -> dict[str, list[int]]:
    """Prefill the prompts (after `start` cached positions) in one step, then decode."""
    params = m.SamplingParams(max_tokens=32)
    out = runner.run(m.Step(1, tuple(m.SeqWork(r, p[start:], start, tables[r], True, params)
                                     for r, p in prompts.items()), 1), {})
    for i in range(steps):
        work = tuple(m.SeqWork(r, (out[r][-1],), len(p) + i, tables[r], True, params, num_generated=len(out[r]))
                     for r, p in prompts.items())
        for r, t in runner.run(m.Step(2 + i, work, 1), {}).items():
            out[r] += t
    return out


@pytest.mark.parametrize("fuse_blocks", [False, True])
def test_short_prompts_by_rows_give_the_familys_prefill(tiny_llama, fuse_blocks):
    """Each prompt token a row of one decode step, reading the table up to itself: the
    same greedy tokens as the family's prefill, for one prompt, two in one group, and a
    prompt after cached positions (a prefix hit), through the fused blocks' ops path too."""
    prompts = {"a": tuple(range(5, 18)), "b": tuple(range(40, 47))}
    tables = {"a": (9, 3, 7, 5, 20, 21), "b": (11, 2, 30, 31)}
    by_rows, family = rows_runner(tiny_llama, 64, fuse_blocks), rows_runner(tiny_llama, 0, fuse_blocks)
    for runner in (by_rows, family):
        runner.pool.ensure_capacity(40)
    assert by_rows.prefill_rows == 64 and family.prefill_rows == 0
    for rows in (["a"], ["a", "b"]):
        want = greedy(family, {r: prompts[r] for r in rows}, tables)
        assert greedy(by_rows, {r: prompts[r] for r in rows}, tables) == want
    # (a's 13 tokens and b's 7 are two groups: padding b to 13 is too much)
    assert by_rows.row_prefills == 3 and family.row_prefills == 0
    # a prefix hit: both pools hold a's first 8 positions as the family wrote them, and
    # the prompt's 5 others come by rows or through the family's prefill
    greedy(family, {"a": prompts["a"]}, tables, steps=0)
    by_rows.pool.keys, by_rows.pool.values = list(family.pool.keys), list(family.pool.values)
    got = greedy(by_rows, {"a": prompts["a"]}, tables, start=8)
    assert by_rows.row_prefills == 4
    assert got == greedy(family, {"a": prompts["a"]}, tables, start=8)
    # more tokens than prefill_rows: the family's prefill
    by_rows.prefill_rows = 12
    greedy(by_rows, {"a": prompts["a"]}, tables)
    assert by_rows.row_prefills == 4


def test_a_prefill_rows_setting_that_is_no_count_is_refused():
    """Before the model loads (and its weights are wired into this process)."""
    from unikern.errors import ConfigError
    from unikern.platform.pinning import WeightWiring
    from unikern.stages.execute.ranks import prepare_model
    from unikern.stages.execute.stage import MLXExecuteParams

    for bad in (-1, "64"):
        with pytest.raises(ConfigError, match="execute.prefill_rows"):
            prepare_model(MLXExecuteParams(model="no/such/model", prefill_rows=bad), None, WeightWiring())


@pytest.mark.parametrize("prefill_rows, compile_prefill, steps", [(0, False, 18), (64, False, 19), (0, True, 20)])
def test_warm_up_runs_the_prefill_by_rows_or_traced_too_where_it_is_on(tiny_llama, prefill_rows, compile_prefill,
                                                                        steps):
    from unikern.stages.execute.warmup import warm_up

    model, _ = load(tiny_llama)
    report = warm_up(model, ModelGeometry(model), False, False, paged_attention=True, prefill_rows=prefill_rows,
                     compile_prefill=compile_prefill)
    assert report["ran"] and report["steps"] == steps
    # each step named and timed: the prompts first, one row alone among them, then the decodes
    labels = [line.rsplit(":", 1)[0] for line in report["step_seconds"]]
    assert len(labels) == steps and labels[:2] == ["prefill x2", "prefill x1"] and labels[-1] == "decode x2 4 steps"
    # a prompt of two rows ran as one forward (traced: 2 rows at the 32-token bucket), as did one of one row
    assert report["traced_prefill"] == (["1x32/224", "2x32/224"] if compile_prefill else [])


def test_warm_up_runs_the_prompts_going_on_after_written_blocks_through_each_pool_read(tiny_llama, monkeypatch):
    """A prefix-cache hit or a long prompt's later chunk reads the pool back: gathers with
    a mask per row (several rows), slices (one row on consecutive blocks) or gathers with
    a causal mask (one row on scattered blocks). The warm-up runs all three, so that the
    kernels they need are built before ready and not inside the first such requests."""
    from unikern.stages.execute import layouts
    from unikern.stages.execute.warmup import warm_up

    seen = set()
    build = layouts.BatchLayout.build.__func__

    def recording(cls, pool, rows):
        layout = build(cls, pool, rows)
        if layout.num_tokens > 1 and any(start > 0 for _, start, _ in rows):
            kind = "slices" if layout.span is not None else "mask per row" if not isinstance(layout.mask, str) else "causal"
            seen.add((layout.batch_size, kind))
        return layout

    monkeypatch.setattr(layouts.BatchLayout, "build", classmethod(recording))
    model, _ = load(tiny_llama)
    report = warm_up(model, ModelGeometry(model), False, False, paged_attention=True, prefill_rows=64)
    assert seen == {(2, "mask per row"), (1, "slices"), (1, "causal")}
    labels = [line.rsplit(":", 1)[0] for line in report["step_seconds"]]
    assert labels.count("resume x2") == 1 and labels.count("resume x1") == 2


def gather_index_counts(*arrays: mx.array) -> list[int]:
    """The index arrays each Gather in the arrays' graph takes (its inputs but the source)."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        dot = f.read()
    gathers = re.findall(r'\{ (\d+) \[label ="Gather"', dot)
    return [len(re.findall(rf'-> {g}\n', dot)) - 1 for g in gathers]


def test_the_model_reads_one_token_dtype_through_single_index_gathers(tiny_llama):
    # on CUDA MLX compiles a gather kernel at run time for each (dtype, index dtype, index
    # count) it meets: prompts are fed in the sampled tokens' dtype, and the rows' last
    # positions are picked by the embedding's kind of gather (paged_cache.rows_at), not by
    # a two-index one
    model, _ = load(tiny_llama)
    pool = small_pool(24, ModelGeometry(model))
    pool.ensure_capacity(24)
    runner = ModelRunner(model, pool)
    fed = []

    class Recording:  # the token ids fed to the model, or to its inner model (runner.head's path)
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            value = getattr(self.target, name)
            return Recording(value) if name == "model" else value

        def __call__(self, inputs, cache=None):
            fed.append(inputs.dtype)
            return self.target(inputs, cache=cache)

    runner.model = Recording(model)
    rows = [((2, 3, 4, 5), 0, 13), ((6, 7, 8, 9), 0, 9)]
    logits = runner._logits(rows, [list(range(5, 18)), list(range(3, 12))])
    assert gather_index_counts(logits) == [1, 1]  # the embedding's, the rows' last positions
    mx.eval(logits, *runner._written())  # (the pool's writes out of the next graph)
    by_rows = runner._logits_by_rows([m.SeqWork("a", (5, 6, 7), 0, (10, 11), True, m.SamplingParams())])
    # by rows, each layer reads its keys and values back through the slots, by the same
    # kind of gather (kv.pool.slot_rows), not pool_k[:, read]'s two-index one
    counts = gather_index_counts(by_rows)
    assert counts == [1] * (2 + 2 * ModelGeometry(model).num_layers), counts
    assert set(fed) == {mx.argmax(logits, axis=-1).dtype}
    mx.eval(by_rows, *runner._written())
