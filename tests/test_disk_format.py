"""The block file format: exact round trips, and every kind of damage detected."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unikern.errors import UnikernError
from unikern.stages.tiers.disk import format as disk_format
from unikern.stages.tiers.disk.format import (
    FIXED_HEADER,
    FORMAT_VERSION,
    MAGIC,
    BlockFormatError,
    Codec,
    CorruptBlockError,
    decode_block,
    encode_block,
    parse_header,
    shuffle,
)

KEY = bytes(range(16, 48))
FLOAT_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_like(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Float KV-like values as raw bytes; bfloat16 is float32's high half."""
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape))).astype(np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).reshape(shape)
    return values.astype(np.dtype(dtype)).reshape(shape)


@pytest.fixture(scope="module")
def block() -> bytes:
    payload = kv_like("bfloat16", (2, 2, 8, 2, 16))
    return encode_block(KEY, payload, dtype="bfloat16", shape=payload.shape, token_count=7)


@settings(max_examples=60, deadline=None, database=None)
@given(
    dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=4).map(tuple),
    seed=st.integers(0, 2**16),
    codec=st.sampled_from([None, Codec.RAW, Codec.ZSTD_SHUFFLE]),
    token_count=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_byte_exact(dtype, shape, seed, codec, token_count):
    raw = np.random.default_rng(seed).integers(
        0, 256, int(np.prod(shape)) * FLOAT_DTYPES[dtype], np.uint8
    )
    data = encode_block(
        KEY, memoryview(raw), dtype=dtype, shape=shape, token_count=token_count, codec=codec
    )
    decoded = decode_block(data, expected_key=KEY)
    assert decoded.payload.tobytes() == raw.tobytes()
    assert (decoded.dtype, decoded.shape, decoded.token_count) == (dtype, shape, token_count)


# Normal(0,1) floats: bfloat16 has 8 exponent bits in one byte plane, so it gains most.
@pytest.mark.parametrize(
    ("dtype", "min_ratio"), [("bfloat16", 1.2), ("float16", 1.04), ("float32", 1.04)]
)
def test_float_kv_compresses_and_round_trips(dtype, min_ratio):
    payload = kv_like(dtype, (2, 2, 64, 4, 32))
    data = encode_block(KEY, payload, dtype=dtype, shape=payload.shape, token_count=64)
    assert parse_header(data).codec is Codec.ZSTD_SHUFFLE
    assert payload.nbytes / len(data) > min_ratio
    assert decode_block(data, expected_key=KEY).payload.tobytes() == payload.tobytes()


def test_shuffle_groups_bytes_by_position():
    raw = np.array([0x0201, 0x0403, 0x0605], np.uint16).view(np.uint8)
    assert shuffle(raw, 2).tolist() == [0x01, 0x03, 0x05, 0x02, 0x04, 0x06]


def test_shuffle_beats_plain_zstd_on_bfloat16():
    payload = kv_like("bfloat16", (2, 2, 128, 4, 64))
    shuffled = encode_block(KEY, payload, dtype="bfloat16", shape=payload.shape, token_count=128)
    plain = disk_format._compressor(3).compress(payload.tobytes())
    assert len(shuffled) < len(plain) * 0.95


def test_incompressible_payload_is_stored_raw():
    raw = np.random.default_rng(1).integers(0, 256, 4096, np.uint8)
    data = encode_block(KEY, raw, dtype="float32", shape=(1024,), token_count=1)
    header = parse_header(data)
    assert header.codec is Codec.RAW and header.body_length == raw.nbytes


def test_header_fields():
    payload = kv_like("float16", (3, 5))
    data = encode_block(KEY, payload, dtype="float16", shape=(3, 5), token_count=5)
    header = parse_header(data)
    assert data[:4] == MAGIC and header.version == FORMAT_VERSION
    assert (header.dtype, header.element_size, header.shape) == ("float16", 2, (3, 5))
    assert (header.token_count, header.raw_length, header.key) == (5, 30, KEY)
    assert header.file_length == len(data)
    assert len(header.checksum) == 16


def test_decode_into_out_buffer_writes_in_place():
    payload = kv_like("bfloat16", (4, 16, 8))
    data = encode_block(KEY, payload, dtype="bfloat16", shape=payload.shape, token_count=16)
    pool = np.zeros(payload.nbytes * 3, np.uint8)
    destination = pool[payload.nbytes : 2 * payload.nbytes]
    decoded = decode_block(data, expected_key=KEY, out=destination)
    assert np.shares_memory(decoded.payload, pool)
    assert destination.tobytes() == payload.tobytes()
    assert not pool[: payload.nbytes].any() and not pool[2 * payload.nbytes :].any()


def test_decode_into_out_buffer_of_wrong_size_is_refused(block):
    with pytest.raises(BlockFormatError, match="out is"):
        decode_block(block, expected_key=KEY, out=np.empty(3, np.uint8))


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_single_byte_flip_is_detected(block, data):
    position = data.draw(st.integers(0, len(block) - 1), label="position")
    flip = data.draw(st.integers(1, 255), label="xor")
    damaged = bytearray(block)
    damaged[position] ^= flip
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(damaged), expected_key=KEY)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.ZSTD_SHUFFLE])
@pytest.mark.parametrize("xor", [0x01, 0x80])
def test_every_single_bit_flip_position_is_detected(codec, xor):
    payload = kv_like("bfloat16", (2, 2, 8, 2, 8))
    data = encode_block(
        KEY, payload, dtype="bfloat16", shape=payload.shape, token_count=8, codec=codec
    )
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= xor
        with pytest.raises(CorruptBlockError):
            decode_block(bytes(damaged), expected_key=KEY)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.ZSTD_SHUFFLE])
def test_every_truncation_is_detected(codec):
    payload = kv_like("float16", (4, 8))
    data = encode_block(KEY, payload, dtype="float16", shape=(4, 8), token_count=8, codec=codec)
    for length in range(len(data)):
        with pytest.raises(CorruptBlockError, match="truncated"):
            decode_block(data[:length], expected_key=KEY)


def test_trailing_bytes_are_detected(block):
    with pytest.raises(CorruptBlockError, match="trailing"):
        decode_block(block + b"\0", expected_key=KEY)


def test_wrong_key_is_detected(block):
    with pytest.raises(CorruptBlockError, match="key mismatch"):
        decode_block(block, expected_key=bytes(32))


def test_wrong_version_is_reported_as_such(block):
    damaged = bytearray(block)
    damaged[4] = FORMAT_VERSION + 1
    with pytest.raises(CorruptBlockError, match="version"):
        decode_block(bytes(damaged), expected_key=KEY)


def test_bad_magic_is_reported_as_such(block):
    with pytest.raises(CorruptBlockError, match="magic"):
        decode_block(b"XXXX" + block[4:], expected_key=KEY)


def _rewrite_header(data: bytes, **changes: int) -> bytes:
    """Change fixed-header fields and recompute the header crc, as a buggy writer would."""
    fields = list(FIXED_HEADER.unpack_from(data))
    names = ["magic", "version", "codec", "element_size", "ndim", "dtype_len", "key_len",
             "kind", "token_count", "raw_length", "body_length", "checksum", "body_crc"]  # fmt: skip
    for name, value in changes.items():
        fields[names.index(name)] = value
    header = parse_header(data)
    crc_at = header.header_length - 4
    head = FIXED_HEADER.pack(*fields) + data[FIXED_HEADER.size : crc_at]
    return head + struct.pack("<I", zlib.crc32(head)) + data[header.header_length :]


def test_raw_body_of_the_wrong_length_is_detected():
    payload = kv_like("float16", (8,))
    data = encode_block(KEY, payload, dtype="float16", shape=(8,), token_count=1, codec=Codec.RAW)
    header = parse_header(data)
    body = data[header.header_length : -2]
    forged = _rewrite_header(
        data[: header.header_length] + body, body_length=len(body), body_crc=zlib.crc32(body)
    )
    with pytest.raises(CorruptBlockError, match="raw body"):
        decode_block(forged, expected_key=KEY, out=np.empty(16, np.uint8))


def test_unknown_codec_is_detected(block):
    with pytest.raises(CorruptBlockError, match="codec"):
        decode_block(_rewrite_header(block, codec=9), expected_key=KEY)


def test_body_flip_is_caught_by_the_body_checksum():
    payload = kv_like("float32", (64,))
    data = encode_block(KEY, payload, dtype="float32", shape=(64,), token_count=1, codec=Codec.RAW)
    with pytest.raises(CorruptBlockError, match="body checksum"):
        decode_block(data[:-1] + bytes([data[-1] ^ 1]), expected_key=KEY)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.ZSTD_SHUFFLE])
def test_payload_checksum_catches_a_body_that_decodes_wrong(codec):
    payload = kv_like("float32", (64,))
    data = encode_block(KEY, payload, dtype="float32", shape=(64,), token_count=1, codec=codec)
    header = parse_header(data)
    if codec is Codec.RAW:
        body = bytes(payload.view(np.uint8) ^ np.uint8(1))
    else:  # a well-formed frame of other content, as a writer bug would produce
        body = disk_format._compressor(3).compress(bytes(header.raw_length))
    forged = _rewrite_header(
        data[: header.header_length] + body, body_length=len(body), body_crc=zlib.crc32(body)
    )
    with pytest.raises(CorruptBlockError, match="payload checksum"):
        decode_block(forged, expected_key=KEY)


def test_oversized_zstd_frame_is_refused_before_allocating(block):
    with pytest.raises(CorruptBlockError, match="frame declares"):
        decode_block(_frame_of_wrong_size(block), expected_key=KEY)


def _frame_of_wrong_size(data: bytes) -> bytes:
    # A well-formed frame that would inflate past the header's raw length.
    header = parse_header(data)
    frame = disk_format._compressor(3).compress(bytes(header.raw_length + 2))
    return _rewrite_header(
        data[: header.header_length] + frame, body_length=len(frame), body_crc=zlib.crc32(frame)
    )


def test_corrupt_block_error_is_a_unikern_error():
    assert issubclass(CorruptBlockError, UnikernError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "bfloat17"}, "unknown dtype"),
        ({"shape": (3,)}, "needs"),
        ({"token_count": -1}, "token_count"),
    ],
)
def test_bad_encode_arguments_are_refused(kwargs, match):
    arguments = {"dtype": "float16", "shape": (4,), "token_count": 1} | kwargs
    with pytest.raises(BlockFormatError, match=match):
        encode_block(KEY, np.zeros(4, np.float16), **arguments)


def test_strided_payload_is_refused():
    with pytest.raises(BlockFormatError, match="contiguous"):
        encode_block(
            KEY, np.zeros((4, 4), np.float16)[:, ::2], dtype="float16", shape=(4, 2), token_count=1
        )
