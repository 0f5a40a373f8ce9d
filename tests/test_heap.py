"""execute.freeze_heap: the objects alive once the engine has started are frozen out of
Python's collections while it serves (unikern.platform.heap), and handed back when the
last engine that froze them stops."""

from __future__ import annotations

import gc

import pytest
from conftest import SMALL_KV

import unikern
from unikern.platform import heap


def test_the_last_holder_thaws():
    assert heap.holders() == 0 and gc.get_freeze_count() == 0
    try:
        heap.freeze()
        heap.freeze()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this interpreter's modules, at least
        heap.thaw()
        # one engine is still serving: still frozen (less what was freed meanwhile: frozen
        # objects that die leave the count, and other threads, pytest-xdist's among them,
        # free some; an unfreeze would leave 0)
        assert gc.get_freeze_count() > frozen * 0.9
    finally:
        while heap.holders():
            heap.thaw()
    assert gc.get_freeze_count() == 0
    heap.thaw()  # more thaws than freezes: nothing to give back
    assert heap.holders() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("freeze", [True, False])
async def test_an_engine_freezes_while_it_serves(tiny_llama, freeze):
    overrides = {**SMALL_KV, "execute": {"freeze_heap": freeze}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as eng:
        done = await eng.complete(prompt_tokens=[5, 6, 7], max_tokens=4)
        assert len(done.token_ids) == 4
        assert (gc.get_freeze_count() > 0) is freeze
        assert heap.holders() == int(freeze)
    assert gc.get_freeze_count() == 0 and heap.holders() == 0
