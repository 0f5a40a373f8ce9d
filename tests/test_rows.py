"""unikern's row kernel (stages/execute/cuda/rows.cu) in the CPU emulation of CUDA: rows of
a table at indices against numpy, whole 16-byte chunks and a row's short tail, an index
past the table; the embeddings routed to it; on a CUDA GPU, MLX's gather bit for bit. Its
three users in the runner (the embedding, the last positions' rows, the pool's reads) give
the family's tokens in tests/test_decode_blocks.py's chunked-prompt test."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests import cuda_emulation
from unikern.platform import cuda_is_default
from unikern.stages.execute import embeddings
from unikern.stages.execute.cuda import rows

emulation = pytest.mark.skipif(not cuda_emulation.available(), reason="needs g++ with C++20 (the CUDA emulation)")


@emulation
@pytest.mark.parametrize("width", [8, 6, 3])  # two whole chunks of 4 float32; a short tail; one short chunk
@pytest.mark.parametrize("index_dtype", [mx.uint32, mx.int32])
def test_take_gives_the_tables_rows_and_zeros_past_it(monkeypatch, width, index_dtype):
    monkeypatch.setattr(rows, "cuda_kernel", cuda_emulation.emulated_cuda_kernels())
    table = np.arange(5 * width, dtype=np.float32).reshape(5, width) + 0.5
    ids = np.array([[4, 0, 2], [2, 7, 1]])  # 7: past the table's 5 rows
    got = np.array(rows.take(mx.array(table), mx.array(ids, dtype=index_dtype)))
    want = np.concatenate([table, np.zeros((3, width), np.float32)])[np.minimum(ids, 5)]
    assert got.shape == (2, 3, width)
    np.testing.assert_array_equal(got, want)


def test_take_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="2-d table at integer indices"):
        rows.take(mx.zeros((2, 3, 4)), mx.array([0]))
    with pytest.raises(ValueError, match="2-d table at integer indices"):
        rows.take(mx.zeros((2, 4)), mx.array([0.0]))


@emulation
def test_route_embeddings_swaps_mlx_embeddings_only_and_keeps_their_weights(monkeypatch):
    launched = []
    monkeypatch.setattr(rows, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))

    class Family(nn.Embedding):  # a family's own subclass keeps its lookup
        pass

    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.own = Family(10, 8)
    weight = model.embed.weight
    assert embeddings.route_embeddings(model) == 1
    assert type(model.embed) is embeddings.RowsEmbedding and type(model.own) is Family
    assert model.embed.weight is weight and "embed.weight" in dict(tree_flatten(model.parameters()))
    ids = mx.array([[3, 9, 0]], dtype=mx.uint32)
    np.testing.assert_array_equal(np.array(model.embed(ids)), np.array(weight[ids]))
    assert launched == ["unikern_rows"]
    x = mx.ones((1, 8))
    np.testing.assert_array_equal(np.array(model.embed.as_linear(x)), np.array(x @ weight.T))


def test_a_quantized_embedding_takes_its_three_arrays_by_the_kernel(monkeypatch):
    """(The emulation runs float32 only: here `take` records its tables and gathers them.)"""
    taken = []
    monkeypatch.setattr(embeddings, "take", lambda table, ids: taken.append(table.dtype) or table[ids])
    embed = nn.Embedding(16, 64)
    embed.weight = mx.random.normal((16, 64), key=mx.random.key(0))
    model = nn.Module()
    model.embed = nn.QuantizedEmbedding.from_embedding(embed, group_size=32, bits=4)
    ids = mx.array([5, 0, 15], dtype=mx.uint32)
    want = np.array(model.embed(ids))
    assert embeddings.route_embeddings(model) == 1
    np.testing.assert_array_equal(np.array(model.embed(ids)), want)
    assert taken == [mx.uint32, mx.float32, mx.float32]  # packed weights, scales, biases


@pytest.mark.skipif(not cuda_is_default(), reason="the kernel runs on a CUDA GPU")
@pytest.mark.parametrize("dtype, width", [(mx.bfloat16, 2048), (mx.bfloat16, 64), (mx.uint32, 256), (mx.float16, 7)])
def test_take_on_cuda_gives_mlxs_gather_bit_for_bit(dtype, width):
    """An embedding table (1B shape), a pool's rows, a 4-bit embedding's packed words and a
    row that ends mid-chunk, at uint32 indices as the engine reads them."""
    table = (mx.random.uniform(shape=(1000, width), key=mx.random.key(1)) * 1000).astype(dtype)
    ids = mx.random.randint(0, 1000, (3, 37), key=mx.random.key(2)).astype(mx.uint32)
    assert mx.array_equal(rows.take(table, ids), table[ids]).item()
