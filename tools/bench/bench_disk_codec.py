"""Compression ratio and speed of the disk tier's block codec on KV-like data.

    python -m tools.bench.bench_disk_codec [--levels 1,3] [--model DIR] [--json out.json]

Rows, per data set:
  shuffle+zstd L   the block format end to end (encode_block / decode_block: byte
                   shuffle, zstd, blake2b and crc32 checks, header)
  shuffle+zstd L*  the codec alone: shuffle + zstd, no checks (what the checks cost)
  plain zstd L     zstd over the unshuffled bytes (the baseline shuffle must beat)
  raw              the block format storing bytes as they are (checks only)
MB/s are of uncompressed bytes, single thread, best of --repeats.

Data sets: synthetic normal(0,1) KV [layers=4, k/v=2, tokens=256, heads=4, dim=64] in
bfloat16 (float32's high half) and float16; with --model, the KV an mlx-lm forward pass
leaves in `make_prompt_cache` caches, cut into blocks of --block-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import zstandard

from unikern.stages.tiers.disk.format import (
    Codec,
    decode_block,
    encode_block,
    shuffle,
    unshuffle_into,
)

SYNTHETIC_SHAPE = (4, 2, 256, 4, 64)
KEY = bytes(range(32))


def synthetic_kv(dtype: str, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(SYNTHETIC_SHAPE).astype(np.float32)
    if dtype == "bfloat16":  # numpy has no bfloat16: keep float32's high 16 bits
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(np.float16)


def model_kv(
    model_dir: Path, prompt_tokens: int, block_tokens: int
) -> tuple[str, list[np.ndarray]]:
    """(dtype, blocks [layers, 2, tokens, kv heads, dim]) from one forward pass."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    vocab = model.args.vocab_size
    tokens = mx.array(np.random.default_rng(0).integers(0, vocab, (1, prompt_tokens)))
    try:
        from mlx_lm.utils import load_tokenizer

        text = Path(__file__).read_text() * 20
        ids = load_tokenizer(model_dir).encode(text)[:prompt_tokens]
        if len(ids) == prompt_tokens:
            tokens = mx.array([ids])
    except Exception:  # no tokenizer files: random ids still give a real forward pass
        pass
    cache = make_prompt_cache(model)
    mx.eval(model(tokens, cache=cache))
    layers = []
    for layer in cache:
        # [1, kv heads, allocated tokens, dim]; only the first `offset` tokens are filled
        keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        layers.append(mx.stack([keys[0], values[0]]).transpose(0, 2, 1, 3))
    kv = mx.stack(layers)  # [layers, 2, tokens, kv heads, dim]
    dtype = str(kv.dtype).removeprefix("mlx.core.")
    if dtype == "bfloat16":
        kv = kv.view(mx.uint16)
    host = np.array(kv)
    usable = host.shape[2] // block_tokens * block_tokens
    blocks = [
        np.ascontiguousarray(host[:, :, start : start + block_tokens])
        for start in range(0, usable, block_tokens)
    ]
    return dtype, blocks


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    label: str, dtype: str, blocks: list[np.ndarray], levels: list[int], repeats: int
) -> Iterator[dict]:
    element_size = blocks[0].dtype.itemsize
    raw_bytes = sum(b.nbytes for b in blocks)
    outs = [np.empty(b.nbytes, np.uint8) for b in blocks]

    def row(name: str, encode: Callable, decode: Callable) -> dict:
        encoded = [encode(b) for b in blocks]
        for block, data, out in zip(blocks, encoded, outs, strict=True):
            decode(data, out)
            assert out.tobytes() == block.tobytes(), f"{name} did not round-trip"
        enc = best_seconds(lambda: [encode(b) for b in blocks], repeats)
        dec = best_seconds(
            lambda: [decode(d, o) for d, o in zip(encoded, outs, strict=True)], repeats
        )
        return {
            "data": label,
            "codec": name,
            "ratio": raw_bytes / sum(len(d) for d in encoded),
            "encode_MBps": raw_bytes / enc / 1e6,
            "decode_MBps": raw_bytes / dec / 1e6,
        }

    def format_encoder(level: int, codec: Codec) -> Callable:
        return lambda b: encode_block(
            KEY, b, dtype=dtype, shape=b.shape, token_count=b.shape[2], level=level, codec=codec
        )

    def format_decode(data: bytes, out: np.ndarray) -> None:
        decode_block(data, expected_key=KEY, out=out)

    decompressor = zstandard.ZstdDecompressor()
    for level in levels:
        compressor = zstandard.ZstdCompressor(level=level)
        yield row(f"shuffle+zstd {level}", format_encoder(level, Codec.ZSTD_SHUFFLE), format_decode)

        def codec_decode(data: bytes, out: np.ndarray) -> None:
            planes = np.frombuffer(decompressor.decompress(data), np.uint8)
            unshuffle_into(planes, element_size, out)

        yield row(
            f"shuffle+zstd {level}*",
            lambda b, c=compressor: c.compress(shuffle(b.reshape(-1).view(np.uint8), element_size)),
            codec_decode,
        )

        def plain_decode(data: bytes, out: np.ndarray) -> None:
            out[...] = np.frombuffer(decompressor.decompress(data), np.uint8)

        yield row(f"plain zstd {level}", lambda b, c=compressor: c.compress(b), plain_decode)
    yield row("raw", format_encoder(3, Codec.RAW), format_decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,3", help="zstd levels, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, help="an mlx-lm model directory for real KV")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]

    data_sets = [
        (name, name, [synthetic_kv(name, seed) for seed in range(4)])
        for name in ("bfloat16", "float16")
    ]
    if args.model is not None:
        dtype, blocks = model_kv(args.model, args.prompt_tokens, args.block_tokens)
        data_sets.append((f"{dtype} model", dtype, blocks))
        print(f"model {args.model}: {dtype}, {len(blocks)} blocks of {blocks[0].shape}")
    rows = []
    print(f"{'data':<14} {'codec':<16} {'ratio':>7} {'encode MB/s':>12} {'decode MB/s':>12}")
    for label, dtype, blocks in data_sets:
        for result in measure(label, dtype, blocks, levels, args.repeats):
            rows.append(result)
            print(
                f"{label:<14} {result['codec']:<16} {result['ratio']:>7.3f} "
                f"{result['encode_MBps']:>12.0f} {result['decode_MBps']:>12.0f}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
