"""The zero-copy bridge: views share memory, copies are counted, strict mode refuses them."""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
import numpy as np
import pytest
import torch

from unikern.errors import RequestError
from unikern.platform.bridge import (
    Bridge,
    BridgeCopyError,
    BridgeError,
    apply_torch_logits_processors,
    mlx_buffer,
)


def evaluated(a: mx.array) -> mx.array:
    mx.eval(a)
    return a


def test_torch_view_shares_memory_with_mlx_and_numpy() -> None:
    bridge = Bridge()
    a = evaluated(mx.arange(12, dtype=mx.float32).reshape(3, 4))
    view = bridge.to_torch(a)
    array = bridge.to_numpy(a)
    assert view.data_ptr() == mlx_buffer(a)[0] == array.ctypes.data
    view[1, 2] = 100.0
    assert a[1, 2].item() == 100.0  # MLX reads the buffer again, nothing cached
    assert array[1, 2] == 100.0
    array[0, 0] = -5.0
    assert view[0, 0].item() == -5.0 and a[0, 0].item() == -5.0
    assert bridge.stats() == {"zero_copy_views": 2, "copies": 0}


def test_lazy_arrays_are_evaluated_then_viewed() -> None:
    bridge = Bridge()
    base = evaluated(mx.ones((4,), dtype=mx.float32))
    lazy = base * 3
    assert bridge.to_torch(lazy).tolist() == [3.0] * 4


def test_mlx_ops_after_a_write_see_it_earlier_results_do_not() -> None:
    bridge = Bridge()
    a = evaluated(mx.ones((4, 4), dtype=mx.float32))
    before = evaluated(a.sum())
    pending = a * 2  # built before the write, evaluated after it
    bridge.to_torch(a)[0, 0] = 10.0
    assert before.item() == 16.0
    assert a.sum().item() == 25.0
    assert pending[0, 0].item() == 20.0


def test_strided_arrays_are_viewed_with_their_strides() -> None:
    bridge = Bridge()
    a = evaluated(mx.arange(12, dtype=mx.float32).reshape(3, 4))
    transposed = bridge.to_torch(a.T)
    assert transposed.stride() == (1, 4)
    assert transposed.data_ptr() == bridge.to_torch(a).data_ptr()
    column = bridge.to_torch(a[:, 1:3])
    assert column.data_ptr() == mlx_buffer(a)[0] + 4
    assert torch.equal(column, torch.tensor([[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]))
    assert bridge.to_numpy(a.T).strides == (4, 16)


def test_negative_strides_are_refused_for_torch_not_copied() -> None:
    bridge = Bridge()
    reversed_ = evaluated(mx.arange(5, dtype=mx.float32)[::-1])
    with pytest.raises(BridgeError, match="negative strides"):
        bridge.to_torch(reversed_)
    assert bridge.to_numpy(reversed_).tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]
    assert bridge.stats() == {"zero_copy_views": 1, "copies": 0}


def test_bfloat16_views_in_torch_and_is_refused_by_numpy() -> None:
    bridge = Bridge()
    a = evaluated(mx.ones((3,), dtype=mx.bfloat16))
    assert bridge.to_torch(a).dtype == torch.bfloat16
    with pytest.raises(BridgeError, match="bfloat16"):
        bridge.to_numpy(a)


def test_a_view_keeps_the_mlx_buffer_alive() -> None:
    bridge = Bridge()
    a = evaluated(mx.arange(1024, dtype=mx.float32))
    view = bridge.to_torch(a)
    del a
    gc.collect()
    mx.clear_cache()
    evaluated(mx.zeros((1024,), dtype=mx.float32) - 7)  # would reuse a freed buffer
    assert view[:3].tolist() == [0.0, 1.0, 2.0]


def test_mlx_does_not_donate_a_viewed_buffer() -> None:
    bridge = Bridge()
    a = evaluated(mx.ones((1024,), dtype=mx.float32))
    view = bridge.to_torch(a)
    a = evaluated(a * 2)  # without a view MLX would write the result into a's buffer
    assert view[0].item() == 1.0 and a[0].item() == 2.0


def test_from_torch_copies_on_cpu_and_counts_it() -> None:
    bridge = Bridge()
    source = torch.arange(6, dtype=torch.float32)
    imported = bridge.from_torch(source)
    source[0] = 99.0
    assert imported.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # an independent copy
    assert bridge.stats() == {"zero_copy_views": 0, "copies": 1}
    halves = bridge.from_torch(torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert halves.dtype == mx.bfloat16 and halves.tolist() == [1.5, 1.5, 1.5]
    assert bridge.copies == 2


def test_strict_mode_raises_instead_of_copying() -> None:
    strict = Bridge(strict=True)
    with pytest.raises(BridgeCopyError, match="would copy 24 bytes"):
        strict.from_torch(torch.zeros(6, dtype=torch.float32))
    assert strict.stats() == {"zero_copy_views": 0, "copies": 0}
    relaxed = Bridge()
    with pytest.raises(BridgeCopyError):
        relaxed.from_torch(torch.zeros(2), strict=True)


def test_a_view_that_is_not_zero_copy_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = Bridge()
    a = evaluated(mx.ones((4,), dtype=mx.float32))
    monkeypatch.setattr(torch, "from_dlpack", lambda array: torch.ones(4))  # a copy
    with pytest.raises(BridgeCopyError, match="did not view"):
        bridge.to_torch(a)
    assert bridge.zero_copy_views == 0


def test_counters_are_thread_safe() -> None:
    bridge = Bridge()
    a = evaluated(mx.ones((8,), dtype=mx.float32))

    def work() -> None:
        for _ in range(200):
            bridge.to_numpy(a)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bridge.zero_copy_views == 800


def test_logits_processors_write_into_the_mlx_logits() -> None:
    bridge = Bridge()
    logits = evaluated(mx.zeros((3, 6), dtype=mx.float32))

    def ban_history(token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        row[token_ids] = -float("inf")
        return row  # masked in place: no copy

    def boost_last(token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        boosted = row.clone()  # a different buffer: its values go back into the row
        boosted[5] += 4.0
        return boosted

    apply_torch_logits_processors(
        logits, [(0, [ban_history], [0, 1, 2]), (2, [ban_history, boost_last], [5, 4])], bridge
    )
    inf = float("inf")
    assert logits.tolist() == [
        [-inf, -inf, -inf, 0.0, 0.0, 0.0],
        [0.0] * 6,
        [0.0, 0.0, 0.0, 0.0, -inf, -inf],
    ]
    assert mx.argmax(logits, axis=1).tolist() == [3, 0, 0]
    assert bridge.stats() == {"zero_copy_views": 1, "copies": 0}  # one view for the batch


def test_logits_processor_errors() -> None:
    bridge = Bridge()
    logits = evaluated(mx.zeros((2, 4), dtype=mx.float32))
    with pytest.raises(RequestError, match="out of range"):
        apply_torch_logits_processors(logits, [(2, [], [])], bridge)
    # a processor's own failure (wrong shape, an exception) is its row's, not the batch's
    def boom(ids, row):
        raise KeyError("boom")

    failed = apply_torch_logits_processors(
        logits, [(0, [lambda ids, row: torch.zeros(3)], []), (1, [boom], [])], bridge
    )
    assert set(failed) == {0, 1}
    assert "shape (3,), expected a float tensor of shape (4,)" in failed[0] and "KeyError: 'boom'" in failed[1]
    # anything but a float tensor of the row's shape fails its row, even one sharing its memory
    wrong = {
        "returned shape (3,)": lambda ids, row: row[:3],
        "returned dtype torch.int32": lambda ids, row: row.to(torch.int32),
        "returned list": lambda ids, row: row.tolist(),
        "returned shape (1, 4)": lambda ids, row: row[None],
    }
    for words, processor in wrong.items():
        failed = apply_torch_logits_processors(logits, [(0, [processor], []), (1, [lambda ids, row: row], [])], bridge)
        assert list(failed) == [0] and words in failed[0], (words, failed)

    def mask_in_place(ids, row):  # None: the row was edited in place, the zero-copy way
        row[1] = -5.0

    assert apply_torch_logits_processors(logits, [(0, [mask_in_place], [])], bridge) == {}
    assert bridge.to_torch(logits)[0, 1].item() == -5.0
    with pytest.raises(BridgeError, match="2-D"):
        apply_torch_logits_processors(evaluated(mx.zeros((4,))), [(0, [], [])], bridge)
    shared = evaluated(mx.broadcast_to(mx.zeros((1, 4)), (2, 4)))
    with pytest.raises(BridgeError, match="alias"):
        apply_torch_logits_processors(shared, [(0, [], [])], bridge)


def test_numpy_view_is_writable_and_zero_copy() -> None:
    bridge = Bridge()
    a = evaluated(mx.zeros((2, 3), dtype=mx.float32))
    array = bridge.to_numpy(a)
    assert array.flags.writeable and not array.flags.owndata
    np.copyto(array, np.full((2, 3), 2.0, dtype=np.float32))
    assert a.sum().item() == 12.0
