"""The on-disk format of one record (a KV block, or a recurrent-state checkpoint): a checked
header, then byte-shuffled zstd, so that KV compresses better than with plain zstd and a
damaged or renamed file is always detected. Nothing is trusted before it is checked."""

from __future__ import annotations

import hashlib
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import zstandard

from unikern.errors import UnikernError

# Layout (little-endian):
#     fixed   "<4sBBBBBBHIQQ16sI" magic b"UKKV", version, codec, element size, ndim,
#                                 dtype name length, key length, record kind,
#                                 token count, raw length, body length,
#                                 blake2b-128 of the raw (unshuffled) payload,
#                                 crc32 of the body (a flip zstd would not notice)
#     dtype   ascii name           e.g. b"bfloat16"
#     shape   ndim x uint64
#     key     key length bytes     the record's key: a renamed file is detected
# The record kind (`RecordKind`) was a reserved 0 before state checkpoints: 0 is a KV block.
#     crc32   uint32               over everything above
#     body    body length bytes    zstd frame of the byte planes, or the raw bytes
MAGIC = b"UKKV"
FORMAT_VERSION = 1
FIXED_HEADER = struct.Struct("<4sBBBBBBHIQQ16sI")
HEADER_CRC = struct.Struct("<I")
CHECKSUM_BYTES = 16
# Longest possible header (all length fields at 255): a reader can fetch this much first.
MAX_HEADER_BYTES = FIXED_HEADER.size + 255 + 8 * 255 + 255 + HEADER_CRC.size
# Compression must save at least this fraction of the raw size, else the block is stored raw.
MIN_SAVING_FRACTION = 1 / 32

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
}


class Codec(IntEnum):
    RAW = 0
    ZSTD_SHUFFLE = 1


class RecordKind(IntEnum):
    """What a file holds; a reader names the kind it expects, so one is never read as the other."""

    KV_BLOCK = 0  # keys and values of one logical block
    STATE = 1  # recurrent-layer state after a logical block boundary (a state checkpoint)


class CorruptBlockError(UnikernError):
    """A block file failed a check: bad magic, version, length, key or checksum. Every
    failure to decode a file raises this, naming what was wrong."""


class BlockFormatError(UnikernError, ValueError):
    """A block cannot be encoded or decoded as asked (bad dtype, shape, or `out` size)."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    version: int
    codec: Codec
    dtype: str
    element_size: int
    shape: tuple[int, ...]
    token_count: int
    raw_length: int
    body_length: int
    checksum: bytes
    body_crc: int
    key: bytes
    header_length: int
    kind: RecordKind = RecordKind.KV_BLOCK

    @property
    def file_length(self) -> int:
        return self.header_length + self.body_length


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    dtype: str
    shape: tuple[int, ...]
    token_count: int
    payload: np.ndarray  # flat uint8, raw_length bytes; a view of `out` when one was given


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe, and building one per call costs more than small blocks.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def as_byte_view(payload: memoryview | bytes | np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous buffer, without copying it."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise BlockFormatError(
                "payload must be C-contiguous (a zero-copy view), got a strided array"
            )
        return payload.reshape(-1).view(np.uint8)
    view = memoryview(payload)
    if not view.c_contiguous:
        raise BlockFormatError("payload must be a C-contiguous buffer")
    return np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, np.uint8)


def shuffle(raw: np.ndarray, element_size: int) -> np.ndarray:
    """Byte planes of `raw`: byte 0 of every element, then byte 1, ...

    A float's high byte (sign, exponent) repeats across a tensor while its low mantissa
    bytes are noise; storing the bytes by plane lets zstd find the repetition.
    """
    if element_size == 1:
        return raw
    elements = raw.reshape(-1, element_size)
    planes = np.empty((element_size, elements.shape[0]), np.uint8)
    for i in range(element_size):  # one column copy per plane beats a 2-D transpose copy
        planes[i] = elements[:, i]
    return planes.reshape(-1)


def unshuffle_into(planes: np.ndarray, element_size: int, out: np.ndarray) -> None:
    if element_size == 1:
        out[...] = planes
        return
    elements = out.reshape(-1, element_size)
    by_plane = planes.reshape(element_size, -1)
    for i in range(element_size):
        elements[:, i] = by_plane[i]


def encode_block(
    key: bytes,
    payload: memoryview | bytes | np.ndarray,
    *,
    dtype: str,
    shape: tuple[int, ...],
    token_count: int,
    level: int = 3,
    codec: Codec | None = None,
    kind: RecordKind = RecordKind.KV_BLOCK,
) -> bytes:
    """One record file's bytes. `codec=None` picks zstd+shuffle unless it saves too little.
    `token_count`: tokens the record covers (a state checkpoint: the prefix it follows)."""
    element_size = DTYPE_SIZES.get(dtype)
    if element_size is None:
        raise BlockFormatError(f"unknown dtype {dtype!r}; valid: {sorted(DTYPE_SIZES)}")
    if not isinstance(key, bytes) or not 1 <= len(key) <= 255:
        raise BlockFormatError(f"key must be 1..255 bytes, got {key!r:.80}")
    shape = tuple(int(d) for d in shape)
    if len(shape) > 255 or any(d < 0 for d in shape):
        raise BlockFormatError(f"bad shape {shape}")
    if not 0 <= token_count < 2**32:
        raise BlockFormatError(f"token_count {token_count} out of range")
    if kind not in RecordKind.__members__.values():
        raise BlockFormatError(f"unknown record kind {kind!r}; valid: {[k.name for k in RecordKind]}")
    raw = as_byte_view(payload)
    expected_length = element_size * math.prod(shape)
    if raw.nbytes != expected_length:
        raise BlockFormatError(
            f"payload is {raw.nbytes} bytes but {dtype}{list(shape)} needs {expected_length}"
        )

    checksum = hashlib.blake2b(raw, digest_size=CHECKSUM_BYTES).digest()
    body: bytes | np.ndarray = raw
    chosen = Codec.RAW
    if codec is not Codec.RAW:
        compressed = _compressor(level).compress(shuffle(raw, element_size))
        if codec is Codec.ZSTD_SHUFFLE or len(compressed) <= raw.nbytes * (1 - MIN_SAVING_FRACTION):
            body, chosen = compressed, Codec.ZSTD_SHUFFLE

    dtype_name = dtype.encode("ascii")
    header = b"".join(
        (
            FIXED_HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                chosen,
                element_size,
                len(shape),
                len(dtype_name),
                len(key),
                RecordKind(kind),
                token_count,
                raw.nbytes,
                len(body),
                checksum,
                zlib.crc32(body),
            ),
            dtype_name,
            struct.pack(f"<{len(shape)}Q", *shape),
            key,
        )
    )
    return b"".join((header, HEADER_CRC.pack(zlib.crc32(header)), body))


def parse_header(data: bytes | memoryview) -> BlockHeader:
    """Check and parse the header only; `data` may stop right after it (the body is not read)."""
    data = memoryview(data)
    if len(data) < FIXED_HEADER.size:
        raise CorruptBlockError(
            f"truncated: {len(data)} bytes, the fixed header alone is {FIXED_HEADER.size}"
        )
    (
        magic,
        version,
        codec_id,
        element_size,
        ndim,
        dtype_length,
        key_length,
        kind_id,
        token_count,
        raw_length,
        body_length,
        checksum,
        body_crc,
    ) = FIXED_HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(
            f"unsupported format version {version}, this build reads {FORMAT_VERSION}"
        )
    crc_at = FIXED_HEADER.size + dtype_length + 8 * ndim + key_length
    header_length = crc_at + HEADER_CRC.size
    if len(data) < header_length:
        raise CorruptBlockError(f"truncated: {len(data)} bytes, the header is {header_length}")
    (stored_crc,) = HEADER_CRC.unpack_from(data, crc_at)
    if zlib.crc32(data[:crc_at]) != stored_crc:
        raise CorruptBlockError("header checksum mismatch")

    # The crc matched, so what follows is what the writer wrote; these guard against bad writers.
    try:
        kind = RecordKind(kind_id)
    except ValueError:
        raise CorruptBlockError(
            f"unknown record kind {kind_id}; known: {[(k.value, k.name) for k in RecordKind]}"
        ) from None
    try:
        codec = Codec(codec_id)
    except ValueError:
        raise CorruptBlockError(
            f"unknown codec id {codec_id}; known: {[c.value for c in Codec]}"
        ) from None
    offset = FIXED_HEADER.size
    dtype = bytes(data[offset : offset + dtype_length]).decode("ascii", errors="replace")
    if DTYPE_SIZES.get(dtype) != element_size:
        raise CorruptBlockError(
            f"dtype {dtype!r} with element size {element_size} is not a known pair"
        )
    offset += dtype_length
    shape = struct.unpack_from(f"<{ndim}Q", data, offset)
    offset += 8 * ndim
    key = bytes(data[offset : offset + key_length])
    if element_size * math.prod(shape) != raw_length:
        raise CorruptBlockError(f"raw length {raw_length} does not match {dtype}{list(shape)}")
    if codec is Codec.RAW and body_length != raw_length:
        raise CorruptBlockError(f"raw body is {body_length} bytes, expected {raw_length}")
    return BlockHeader(
        version,
        codec,
        dtype,
        element_size,
        tuple(shape),
        token_count,
        raw_length,
        body_length,
        bytes(checksum),
        body_crc,
        key,
        header_length,
        kind,
    )


def decode_block(
    data: bytes | memoryview,
    *,
    expected_key: bytes,
    out: np.ndarray | None = None,
    expected_kind: RecordKind = RecordKind.KV_BLOCK,
) -> DecodedBlock:
    """Check and decode a record file. With `out` (a writable uint8 array of the raw length)
    the payload lands there directly; if a check then fails, `out` holds garbage.
    Without `out`, a raw-codec payload is a read-only view of `data`."""
    header = parse_header(data)
    if header.kind != expected_kind:
        raise CorruptBlockError(
            f"record kind mismatch: file holds {header.kind.name}, expected {RecordKind(expected_kind).name}"
        )
    if header.key != expected_key:
        raise CorruptBlockError(
            f"key mismatch: file holds {header.key.hex()}, expected {bytes(expected_key).hex()}"
        )
    if len(data) != header.file_length:
        raise CorruptBlockError(
            f"{'truncated' if len(data) < header.file_length else 'trailing bytes'}: "
            f"{len(data)} bytes, header says {header.file_length}"
        )
    if out is not None:
        if out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
            raise BlockFormatError("out must be a writable, C-contiguous uint8 array")
        out = out.reshape(-1)
        if out.nbytes != header.raw_length:
            raise BlockFormatError(f"out is {out.nbytes} bytes, the block is {header.raw_length}")

    body = memoryview(data)[header.header_length :]
    if zlib.crc32(body) != header.body_crc:
        raise CorruptBlockError("body checksum mismatch")
    if header.codec is Codec.RAW:
        raw = np.frombuffer(body, np.uint8)
        if out is not None:
            out[...] = raw
            raw = out
    else:
        planes = _decompress(body, header.raw_length)
        raw = out if out is not None else np.empty(header.raw_length, np.uint8)
        unshuffle_into(planes, header.element_size, raw)
    if hashlib.blake2b(raw, digest_size=CHECKSUM_BYTES).digest() != header.checksum:
        raise CorruptBlockError("payload checksum mismatch")
    return DecodedBlock(header.dtype, header.shape, header.token_count, raw)


def _decompress(body: memoryview, raw_length: int) -> np.ndarray:
    # Check the frame's declared size first: a corrupt size must not drive a huge allocation.
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"bad zstd frame header: {exc}") from None
    if declared != raw_length:
        raise CorruptBlockError(f"zstd frame declares {declared} bytes, header says {raw_length}")
    try:
        planes = _decompressor().decompress(body, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd body does not decompress: {exc}") from None
    if len(planes) != raw_length:
        raise CorruptBlockError(f"body decompressed to {len(planes)} bytes, expected {raw_length}")
    return np.frombuffer(planes, np.uint8)
