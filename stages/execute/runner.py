"""Runs one scheduled step as batched forwards over block tables. The only tensor code
of the step loop; always called on the execute stage's own thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx

from unikern import messages as m
from unikern.platform import blas, cuda_is_default, shared_bridge
from unikern.platform.bridge import Bridge, apply_torch_logits_processors
from unikern.stages.execute.compiled import CompiledDecode, CompiledPrefill
from unikern.stages.execute.layouts import BatchLayout, DecodeWindow
from unikern.stages.execute.memory import device_memory_error, is_out_of_memory
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.paged_cache import (
    TOKEN_DTYPE,
    PagedLayerCache,
    flat_positions,
    pool_writer,
    rows_at,
    take_rows,
)
from unikern.stages.execute.prompt_logprobs import (
    pending_arrays,
    prompt_forward,
    prompt_reports,
    with_prompt_reports,
)
from unikern.stages.execute.recurrent import StateLayerCache, prepare_states
from unikern.stages.execute.sampling import SamplingBatch, row_is_usable
from unikern.stages.execute.streaming import WindowStream
from unikern.stages.execute.structured import GrammarStep
from unikern.stages.kv.pool import KVPool
from unikern.stages.kv.state_pool import StatePool

# prefill rows are grouped into one padded forward while the padding stays under this
PREFILL_PADDING_LIMIT = 1.25

# forwards of fewer tokens than this run their BLAS calls on one thread: a GEMM of a
# few rows is too small to split, and waking a second thread costs more than it gives
SINGLE_THREAD_TOKENS = 16


def split_head(model: Any) -> Callable[[mx.array], mx.array] | None:
    """The model's output head alone, if it is `model.model` followed by lm_head (or
    tied embeddings), checked on a probe. It lets a prefill compute logits for its last
    position only instead of for every prompt token."""
    from mlx_lm.models.cache import make_prompt_cache

    inner = getattr(model, "model", None)
    if inner is None:
        return None
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False):
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            return None
        head = embed.as_linear
    elif hasattr(model, "lm_head"):
        head = model.lm_head
    else:
        return None
    probe = mx.array([[1, 2, 3]], dtype=TOKEN_DTYPE)
    try:
        full = model(probe, cache=make_prompt_cache(model))[:, -1, :]
        split = head(inner(probe, cache=make_prompt_cache(model))[:, -1, :])
        same = bool(mx.array_equal(full, split))
    except Exception:  # an unusual family: keep the full forward
        return None
    return head if same else None


class ModelRunner:
    def __init__(
        self,
        model: Any,
        pool: KVPool,
        bridge: Bridge | None = None,
        cpu_kernels: bool = False,
        compile_decode: bool = False,
        geometry: ModelGeometry | None = None,
        window_pool: KVPool | None = None,
        states: StatePool | None = None,
        paged_attention: bool = False,
        compile_one_row: bool = False,
        prefill_rows: int = 0,
        compile_prefill: bool = False,
    ) -> None:
        """`window_pool`: a mixed model's windowed layers when they keep their own pool and
        tables (SeqWork.window_table); `pool` then holds the full layers alone.
        `prefill_rows`: prompts of up to this many tokens (a group's in all) run as one
        decode step of a row per token (`_logits_by_rows`); 0: off. `compile_prefill`:
        forwards of fresh prompts through one traced function per length bucket
        (compiled.CompiledPrefill)."""
        self.model = model
        geometry = geometry or ModelGeometry(model)
        # per cache entry: which pool layer and window; None: every layer full attention
        self.layers = None if geometry.is_plain else geometry.layers
        self.window_pool = window_pool
        if window_pool is not None:  # each group's layers numbered within its own pool
            kinds = [s.kind for s in geometry.layers]
            self.layers = tuple(
                replace(s, index=kinds[:i].count(s.kind)) if s.kind != "state" else s
                for i, s in enumerate(geometry.layers)
            )
        # recurrent layers' slots and checkpoints (ArraysCache models; the kv service's,
        # which the offload mover also reaches); None: none
        if states is None and geometry.has_state:
            states = StatePool([s.state for s in geometry.layers if s.kind == "state"])
        self.states = states if geometry.has_state else None
        # right padding would run padded steps through recurrences, which not every
        # mlx-lm family masks (nemotron-h does not): such models batch equal lengths only
        self.padding_limit = 1.0 if self.states is not None else PREFILL_PADDING_LIMIT
        self.pool = pool
        self.bridge = bridge or shared_bridge()  # logits processors' and grammar masks' views
        self.num_layers = pool.num_layers
        self.head = split_head(model)
        self.kernels: dict[str, Any] = {"enabled": False, "reason": "off (cpu_kernels: false or not the CPU backend)"}
        if cpu_kernels:
            from unikern.stages.execute.cpu_kernels import install

            self.kernels = install(model, pool.dtype)
        # decode steps of full-attention layers read the pool in one kernel (CUDA) or
        # through MLX's ops (elsewhere, for tests), through the routed SDPA
        self.paged: str | None = None
        self.paged_report: dict[str, Any] = {"enabled": False, "reason": "off (execute.paged_attention)"}
        if paged_attention:
            from unikern.stages.execute.routing import layers_of, route_attention

            routed = sum(route_attention(layer) for layer in layers_of(model))
            if routed:
                self.paged = "kernel" if cuda_is_default() else "reference"
                self.paged_report = {"enabled": True, "mode": self.paged, "routed_layers": routed}
            else:
                self.paged_report = {"enabled": False, "reason": "no attention layer calls a routable SDPA"}
        # the CPU kernels evaluate arrays mid-forward, which a traced function cannot
        traceable = not self.kernels["enabled"] and self.layers is None
        self.compiled = CompiledDecode(model, self.num_layers, self.paged) if compile_decode and traceable else None
        self.compiled_prefill = (CompiledPrefill(model, self.num_layers, self.head, self.paged)
                                 if compile_prefill and traceable and self.states is None else None)
        # one-row windows traced too: only with no mask to give MLX's SDPA (paged above)
        self.compile_one_row = compile_one_row and self.paged is not None and self.compiled is not None
        # rows read the pool through the paged attention: full attention only, no state slots (no recurrences)
        self.prefill_rows = prefill_rows if self.paged is not None and self.layers is None else 0
        self.row_prefills = 0  # forwards that ran prompts by rows (stats)
        # the rows the last step sampled and the tokens it sampled last (a window's last step, or a
        # one-step step), on the device, in its row order: a window planned before they came back
        # (SeqWork.continues) feeds them
        self._carried: tuple[tuple[str, ...], mx.array] | None = None
        self._writes: list[mx.array] = []  # this step's pool write markers (_written)
        self.window_stream: WindowStream | None = None  # windows' tokens as they come (streaming.py)

    def _caches(self, layout: BatchLayout, slots: list[int] | None = None, window_layout: BatchLayout | None = None) -> list:
        """The per-layer caches of one forward; `slots`: the rows' state slots;
        `window_layout`: the windowed layers' own (split layer groups)."""
        kernels = self.kernels["enabled"]
        if self.layers is None:
            return [PagedLayerCache(self.pool, i, layout, kernels, paged=self.paged, writes=self._writes)
                    for i in range(self.num_layers)]
        slot_array = mx.array(slots) if self.states is not None else None
        caches = []
        for s in self.layers:
            if s.kind == "state":
                caches.append(StateLayerCache(self.states, s.index, slot_array))
            elif s.kind == "window" and window_layout is not None:
                caches.append(PagedLayerCache(self.window_pool, s.index, window_layout, kernels, s.window, self.paged,
                                              self._writes))
            else:
                caches.append(PagedLayerCache(self.pool, s.index, layout, kernels, s.window, self.paged, self._writes))
        return caches

    def _written(self) -> list:
        """What a forward writes, evaluated with it: the pool (both groups' pools when split);
        in recurrent models the state slots, which can hold the attention's read of the pool
        pending (nemotron-h's M*M-), and a write into a pool array with a read pending is not
        done in place (MLX copies the whole array: on cpu the whole budget, committed); and
        the step's pool write kernel markers: the kernel writes in place, unseen by MLX, so it
        runs only when something evaluated takes its marker (tests/test_pool_write_markers.py)."""
        written: list = [self.pool.keys, self.pool.values, *self._writes]
        if self.window_pool is not None:
            written += [self.window_pool.keys, self.window_pool.values]
        if self.states is not None:
            written.append(self.states.arrays)
        return written

    def _logits(
        self, rows: list[tuple[tuple[int, ...], int, int]], tokens: list[list[int]], slots: list[int] | None = None,
        window_rows: list[tuple[tuple[int, ...], int, int]] | None = None,
    ) -> mx.array:
        """One forward over right-padded rows; logits [B, vocab] at each row's last token.
        `window_rows`: the same rows with the windowed layers' tables (split groups)."""
        if self.compiled_prefill is not None and not window_rows:
            bucket = self.compiled_prefill.bucket(rows)
            if bucket is not None:
                return self.compiled_prefill(self.pool, rows, tokens, bucket, self._writes)
        layout = BatchLayout.build(self.pool, rows)
        window_layout = BatchLayout.build(self.window_pool, window_rows) if window_rows else None
        caches = self._caches(layout, slots, window_layout)
        T = layout.num_tokens
        inputs = mx.array([t + [0] * (T - len(t)) for t in tokens], dtype=TOKEN_DTYPE)
        if T == 1:
            return self.model(inputs, cache=caches)[:, -1, :]
        last = flat_positions(layout.last_index, T)
        if self.head is not None:
            return self.head(rows_at(self.model.model(inputs, cache=caches), last))
        return rows_at(self.model(inputs, cache=caches), last)

    def _logits_by_rows(self, group: list[m.SeqWork]) -> mx.array:
        """Short prompts' logits [B, vocab] at their last tokens, each prompt's tokens run
        as rows of one decode step: row t at position start + t reads the row's table up
        to itself through the paged attention (a causal prefill, row by row), and the
        blocks take the step through their decode paths (fuse_blocks: its kernels up to
        4 rows, MLX's ops up to 64) rather than the family's prefill code. On an H200 the
        family's 64-token prefill of the 1B shape was 262 kernels and 5.1 ms, 1.4 of them
        on the GPU: the host's encoding paced it (tools/probe/probe_prefill.py)."""
        self.row_prefills += 1
        rows = [(w.block_table, w.start_pos + t, 1) for w in group for t in range(len(w.token_ids))]
        caches = self._caches(BatchLayout.build(self.pool, rows))
        inputs = mx.array([[t] for w in group for t in w.token_ids], dtype=TOKEN_DTYPE)
        ends, last = 0, []
        for w in group:
            ends += len(w.token_ids)
            last.append(ends - 1)
        index = mx.array(last, dtype=TOKEN_DTYPE)  # rows of one position: rows_at's indices
        if self.head is not None:
            return self.head(rows_at(self.model.model(inputs, cache=caches), index))
        return rows_at(self.model(inputs, cache=caches), index)

    def run(self, step: m.Step, seeds: dict[str, int]) -> dict[str, list[int]]:
        """The step's sampled tokens alone (warm-up, tools, tests)."""
        return self.execute(step, seeds).sampled

    def execute(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        """Run the step: its tokens, the log-probabilities asked for, the requests whose
        grammar completed and those that failed on their own (processor, grammar). MLX's
        allocation failure comes out as DeviceMemoryError, naming what to change."""
        try:
            return self._execute(step, seeds)
        except RuntimeError as exc:
            if is_out_of_memory(exc):
                raise device_memory_error(exc, (self.pool, self.window_pool)) from exc
            raise

    def _execute(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        self._writes.clear()  # the last step's, evaluated with it
        highest = max((max(w.block_table) for w in step.work if w.block_table), default=-1)
        highest = max([highest, *(max(source, dest) for source, dest, _ in step.copies)])
        self.pool.ensure_capacity(highest + 1)
        # partial prefix hits, before any row reads them; on CUDA by unikern's write kernel
        self.pool.copy_prefixes(step.copies, pool_writer(self.paged), take_rows)
        if self.window_pool is not None:
            highest = max((max(w.window_table) for w in step.work if w.window_table), default=-1)
            self.window_pool.ensure_capacity(highest + 1)
        small = sum(len(w.token_ids) for w in step.work) < SINGLE_THREAD_TOKENS
        previous = blas.set_num_threads(1) if small else None
        try:
            if self.states is None:
                return self._run_lookahead(step, seeds) if step.num_steps > 1 else self._run_once(step, seeds)
            # restore slots and save checkpoints inside chunks before, the chunks' ends after
            pieces: list[m.StepDone] = []
            step, after = prepare_states(self.states, step, lambda piece: pieces.append(self._run_once(piece, seeds)))
            done = self._run_lookahead(step, seeds) if step.num_steps > 1 else self._run_once(step, seeds)
            self.states.copy(after)
            mx.eval(self.states.arrays)
            return with_prompt_reports(done, {}, pieces) if any(p.prompt_logprobs for p in pieces) else done
        finally:
            if previous is not None:
                blas.set_num_threads(previous)

    def _run_once(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        if any(w.continues for w in step.work):
            raise RuntimeError("a continuing row needs a window (num_steps > 1): Scheduler.follow_up plans none shorter")
        decodes = [w for w in step.work if len(w.token_ids) == 1]
        prefills = sorted((w for w in step.work if len(w.token_ids) > 1), key=lambda w: -len(w.token_ids))
        groups = [decodes] if decodes else []
        for w in prefills:  # longest first; a row joins a group while padding stays small
            group = groups[-1] if groups and len(groups[-1][0].token_ids) > 1 else None
            if group is not None:
                fed = sum(len(x.token_ids) for x in group) + len(w.token_ids)
                if len(group[0].token_ids) * (len(group) + 1) <= self.padding_limit * fed:
                    group.append(w)
                    continue
            groups.append([w])
        logits_rows: list[mx.array] = []
        order: list[m.SeqWork] = []
        prompts = []  # the prompt log-probabilities asked for (prompt_logprobs.Pending)
        for group in groups:
            rows = [(w.block_table, w.start_pos, len(w.token_ids)) for w in group]
            window_rows = None
            if self.window_pool is not None:
                window_rows = [(w.window_table, w.start_pos, len(w.token_ids)) for w in group]
            if any(w.prompt_targets for w in group):  # every position's logits, op by op
                logits, pending = prompt_forward(self, group, rows, window_rows)
                prompts += pending
            elif len(group[0].token_ids) > 1 and sum(len(w.token_ids) for w in group) <= self.prefill_rows:
                logits = self._logits_by_rows(group)
            else:
                logits = self._logits(rows, [list(w.token_ids) for w in group], [w.state_slot for w in group],
                                      window_rows)
            if prompts:  # their small results now, before the next group or the sampling
                mx.eval(logits, *pending_arrays(prompts))
            if group is not groups[-1]:
                # the next group writes the pool: this one's reads must be done first, or MLX
                # copies every layer's whole array to keep them for it (the budget, on cpu)
                mx.eval(logits, *self._written())
            if all(w.sample for w in group):
                logits_rows.append(logits)
                order.extend(group)
            else:
                for i, w in enumerate(group):
                    if w.sample:
                        logits_rows.append(logits[i : i + 1])
                        order.append(w)
        self._carried = None
        if not order:  # the state slots are this forward's only output: they read the pool
            mx.eval(*self._written())
            done = m.StepDone(step.step_id, {})
        else:
            stacked = logits_rows[0] if len(logits_rows) == 1 else mx.concatenate(logits_rows)
            done = self._sample(step.step_id, order, stacked, seeds)
        return with_prompt_reports(done, prompt_reports(prompts)) if prompts else done

    def _sample(self, step_id: int, order: list[m.SeqWork], logits: mx.array, seeds: dict[str, int]) -> m.StepDone:
        """Every row in one pass: its PyTorch processors, bias and penalties, grammar mask,
        draw and log-probabilities. A row whose processor or matcher fails, or that is
        left with no possible token, is dropped with the reason; the others go on."""
        batch = SamplingBatch(order, seeds)
        failed: dict[str, str] = {}
        constrained = [(i, w.request_id, w.grammar) for i, w in enumerate(order) if w.grammar is not None]
        grammar = None
        if constrained:
            mx.async_eval(logits)  # the forward computes while the grammar engine fills masks
            grammar = GrammarStep(constrained, len(order), logits.shape[-1], self.bridge)
        with_processors = [(i, w.processors, list(w.history)) for i, w in enumerate(order) if w.processors]
        if with_processors:
            # one evaluated float32 buffer; processors mask it in place through a view
            logits = logits.astype(mx.float32)
            mx.eval(logits)
            for i, why in apply_torch_logits_processors(logits, with_processors, self.bridge).items():
                failed[order[i].request_id] = why
        logits = batch.process(logits)
        if grammar is not None:
            logits = grammar.apply(logits)
        tokens = batch.sample(logits)
        # a window planned while this step ran (schedule.overlap_prefill) feeds them
        self._carried = (tuple(w.request_id for w in order), tokens)
        reported = batch.logprobs(logits, tokens) or ()
        guarded = [i for i, w in enumerate(order) if w.processors or w.grammar is not None]
        usable = row_is_usable(logits, guarded) if guarded else mx.array([])
        mx.eval(tokens, usable, *reported, *self._written())
        for i, ok in zip(guarded, usable.tolist(), strict=True):
            if not ok:
                failed.setdefault(order[i].request_id, "no token is possible: the logits processors or "
                                  "the grammar left every token at -inf, or NaN")
        ids = {w.request_id: t for w, t in zip(order, tokens.tolist(), strict=True) if w.request_id not in failed}
        stopped: list[str] = []
        if grammar is not None:
            stopped = grammar.advance(ids)
            failed.update(grammar.failed)
        reports = batch.logprob_reports([[a.tolist() for a in reported]]) if reported else []
        logprobs = {order[i].request_id: r for i, r in zip(batch.logprob_rows, reports, strict=True)}
        return m.StepDone(
            step_id,
            {rid: [t] for rid, t in ids.items() if rid not in failed},
            logprobs={rid: r for rid, r in logprobs.items() if rid not in failed},
            failed=failed,
            stopped=tuple(rid for rid in stopped if rid not in failed),
        )

    def _window_inputs(self, work: tuple[m.SeqWork, ...]) -> mx.array:
        """A window's first tokens (TOKEN_DTYPE, as the sampled tokens fed to later steps
        are: one dtype, one trace): the rows' own, or, for a window planned while the step
        before ran (`continues`), the tokens that step sampled last, still on the device
        (in the window's row order: a prompts' step samples its rows in its own order)."""
        if not any(w.continues for w in work):
            return mx.array([w.token_ids[0] for w in work], dtype=TOKEN_DTYPE)
        rows = tuple(w.request_id for w in work)
        carried = self._carried[0] if self._carried is not None else ()
        if not all(w.continues for w in work) or sorted(carried) != sorted(rows):
            raise RuntimeError(
                f"a continuing window must follow a step of the same rows: got rows {rows}, the last step sampled "
                f"{carried or 'none'} (schedule.overlap_windows plans them in order)"
            )
        if carried == rows:
            return self._carried[1]
        at = {rid: i for i, rid in enumerate(carried)}
        return self._carried[1][mx.array([at[rid] for rid in rows])]

    def _run_lookahead(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        """num_steps decode steps for the same rows, pipelined: the graph of step i+1 is
        built (feeding step i's lazily sampled tokens) while step i computes."""
        work = step.work
        if any(w.processors or w.grammar is not None for w in work):
            raise RuntimeError("a lookahead window cannot carry logits processors or grammars (num_steps must be 1)")
        batch = SamplingBatch(work, seeds, step.num_steps)
        inputs = self._window_inputs(work)
        rows = [(w.block_table, w.start_pos) for w in work]
        # a single row reads and writes the pool through slices (BatchLayout's span): no mask, which keeps
        # MLX on its fused decode kernel; several rows read one host-built slot table, masked, through
        # the compiled step if any (one row too when the attention reads the pool itself: compile_one_row)
        compiled = self.compiled if len(work) > 1 or self.compile_one_row else None
        window = split = None
        if len(work) > 1 or compiled is not None:
            window = DecodeWindow(self.pool, rows, step.num_steps, bucketed=compiled is not None)
            if self.window_pool is not None:
                split = DecodeWindow(self.window_pool, [(w.window_table, w.start_pos) for w in work], step.num_steps)
        sampled: list[mx.array] = []
        reported: list[tuple[mx.array, ...]] = []
        stream = self.window_stream  # the tokens handed on while the window runs (log-probabilities: at its end)
        reader = stream.reader(step.step_id, [w.request_id for w in work]) if stream and not batch.logprob_rows else None
        padding = window.rows_run - len(work) if compiled is not None else 0
        for i in range(step.num_steps):
            if compiled is not None:  # its rows padded to the window's bucket (layouts.row_bucket)
                fed = mx.concatenate([inputs, mx.zeros((padding,), inputs.dtype)]) if padding else inputs
                logits = compiled(self.pool, window, fed, i)
                logits = logits[: len(work)] if padding else logits
            else:
                window_layout = None
                if window is not None:
                    layout = window.step(i)
                    window_layout = split.step(i) if split is not None else None
                else:
                    layout = BatchLayout.build(self.pool, [(w.block_table, w.start_pos + i, 1) for w in work])
                    if self.window_pool is not None:
                        window_layout = BatchLayout.build(
                            self.window_pool, [(w.window_table, w.start_pos + i, 1) for w in work]
                        )
                caches = self._caches(layout, [w.state_slot for w in work], window_layout)
                logits = self.model(inputs[:, None], cache=caches)[:, -1, :]
            logits = batch.process(logits)
            inputs = batch.sample(logits, i)
            batch.advance(inputs)  # penalty windows follow the tokens on the device
            if batch.logprob_rows:
                reported.append(batch.logprobs(logits, inputs))
            mx.async_eval(inputs)
            sampled.append(inputs)
            if reader is not None and self.kernels["enabled"]:  # the CPU kernels computed step i - 1 by now
                reader.read_to(sampled, i)
        self._carried = (tuple(w.request_id for w in work), inputs)
        if reader is not None:  # each step but the last as it finishes (the last: with the StepDone)
            reader.read_to(sampled, step.num_steps - 1)
        columns = mx.stack(sampled, axis=1)  # one sync for the window's tokens and writes
        mx.eval(columns, *(a for r in reported for a in r), *self._written())
        tokens = {w.request_id: row for row, w in zip(columns.tolist(), work, strict=True)}
        reports = batch.logprob_reports([[a.tolist() for a in r] for r in reported]) if reported else []
        logprobs = {work[i].request_id: r for i, r in zip(batch.logprob_rows, reports, strict=True)}
        return m.StepDone(step.step_id, tokens, logprobs=logprobs)
