"""The compression payload's wire format: the 56-byte header, its kind and dtype codes, and the value encodings.

What it is for
--------------
Every payload ``src.compression``'s compressors produce starts with the same fixed header (magic,
version, compressor kind, source dtype, bits, shape, a per-kind parameter, a CRC32 of the rest);
this module packs it and reads it back, checking everything that does not depend on the kind.
What a kind's body holds (and so how long it is) is for the compressor to say: :func:`read_header`
asks through its ``body_size`` argument. It also holds the byte-level helpers every compressor
shares: flat views of bytes-like payloads, joining buffers into one message, and values in
float32, bfloat16 or float16. No I/O; torch, numpy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import types
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Union

import numpy as np
import torch

MAGIC = b"GC"
FORMAT_VERSION = 1
MAX_NDIM = 8

# magic, version, kind, source dtype, bits, ndim, value dtype, numel, param, shape[MAX_NDIM]
# The value-dtype byte was "reserved" (always 0) before values could travel in 16 bits; 0 still
# means float32, so every payload written before reads exactly as it did.
_HEADER_BODY = struct.Struct(f"<2sBBBBBBQI{MAX_NDIM}I")
_HEADER_CRC = struct.Struct("<I")
#: Size in bytes of the fixed header that starts every payload.
HEADER_SIZE = _HEADER_BODY.size + _HEADER_CRC.size  # 56: keeps the buffers 8-byte aligned

BYTES_PER_IDENTITY_ENTRY = 4  # float32
BYTES_PER_TOPK_ENTRY = 8  # float32 value + int32 index
BYTES_PER_INDEX = 4  # int32 index of a kept top-k entry
BYTES_PER_SCALE = 4  # float32 scale per quantization bucket

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1

# Little-endian on the wire whatever the host; these are no-op views on little-endian hosts.
F32 = np.dtype("<f4")
I32 = np.dtype("<i4")


class Kind(enum.IntEnum):
    """Compressor kind codes stored in the header; names match the registry keys."""

    IDENTITY = 0
    TOPK = 1
    QUANTIZATION = 2


# Source dtypes accepted by compress(); everything is sent as float32.
DTYPE_CODES: Mapping[torch.dtype, int] = types.MappingProxyType(
    {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
)
_CODE_DTYPES: Mapping[int, torch.dtype] = types.MappingProxyType({code: dtype for dtype, code in DTYPE_CODES.items()})
# Dtypes values may travel in (identity and top-k), with the same codes as source dtypes.
VALUE_DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
_VALUE_CODES: Mapping[torch.dtype, int] = types.MappingProxyType(
    {dtype: DTYPE_CODES[dtype] for dtype in VALUE_DTYPES.values()}
)

PayloadLike = Union[bytes, bytearray, memoryview, np.ndarray, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PayloadHeader:
    """The decoded fixed header of a payload.

    Attributes:
        kind: which compressor produced the payload.
        source_dtype: dtype of the tensor that was compressed.
        bits: quantization bits (2/4/8), or the bits of each value of identity and top-k (32 for
            float32 values, 16 for bfloat16/float16 ones).
        shape: shape of the compressed tensor.
        numel: number of entries of that tensor.
        param: top-k: ``k``; quantization: ``bucket_size``; identity: 0.
        payload_size: total payload length in bytes the header implies (header included).
        value_dtype: dtype the values travel in (identity, top-k); float32 for quantization,
            whose scales are float32.
    """

    kind: Kind
    source_dtype: torch.dtype
    bits: int
    shape: tuple[int, ...]
    numel: int
    param: int
    payload_size: int
    value_dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        """Registry name of the compressor kind (``"topk"`` ...)."""
        return self.kind.name.lower()


def pack_header(
    kind: Kind,
    source_dtype: torch.dtype,
    bits: int,
    shape: tuple[int, ...],
    numel: int,
    param: int,
    value_dtype: torch.dtype = torch.float32,
) -> bytes:
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    body = _HEADER_BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        int(kind),
        DTYPE_CODES[source_dtype],
        bits,
        len(shape),
        _VALUE_CODES[value_dtype],
        numel,
        param,
        *dims,
    )
    return body + _HEADER_CRC.pack(zlib.crc32(body))


def dense_float32_numel(header: PayloadLike) -> int | None:
    """The entries of the identity payload whose first :data:`HEADER_SIZE` bytes are ``header``, when it carries
    float32 values (its body is then the tensor's values, 4 bytes each, in order); ``None`` for any other payload
    or a header that does not check out. Lets a receiver read a dense gradient's values while its bytes still
    arrive (:mod:`src.ps.state.slice_pipeline`); the whole payload is checked as usual once it is in."""
    raw = bytes(as_buffer(header)[:HEADER_SIZE])
    if len(raw) < HEADER_SIZE:
        return None
    (magic, version, kind_code, _dtype, bits, _ndim, value_code, numel, *_rest) = _HEADER_BODY.unpack_from(raw)
    (crc,) = _HEADER_CRC.unpack_from(raw, _HEADER_BODY.size)
    if magic != MAGIC or version != FORMAT_VERSION or crc != zlib.crc32(raw[: _HEADER_BODY.size]):
        return None
    if kind_code != Kind.IDENTITY or value_code != _VALUE_CODES[torch.float32] or bits != 32:
        return None
    return numel


def as_buffer(payload: PayloadLike) -> memoryview:
    """A flat byte view of ``payload`` without copying (bytes, bytearray, uint8 array/tensor)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(
                f"payload tensor must be 1-D torch.uint8, got {payload.dtype} with shape {tuple(payload.shape)}"
            )
        payload = payload.detach().cpu().contiguous().numpy()
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            raise ValueError(f"payload array must be 1-D uint8, got {payload.dtype} with shape {payload.shape}")
        payload = np.ascontiguousarray(payload)
    try:
        view = memoryview(payload)
    except TypeError:
        raise ValueError(
            f"payload must be bytes-like (bytes, bytearray, memoryview, uint8 array/tensor), "
            f"got {type(payload).__name__}"
        ) from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def read_header(buf: memoryview, body_size: Callable[..., int]) -> PayloadHeader:
    """Decode and validate the header at the start of ``buf``, including that the length matches.

    Args:
        buf: the whole payload, as :func:`as_buffer` returns it.
        body_size: ``body_size(kind, bits=, numel=, param=, value_dtype=)``: the body's length in
            bytes for a payload of that kind; it raises ValueError when the fields are impossible
            for that kind.

    Raises:
        ValueError: bad magic/version/checksum, unknown kind or dtype, inconsistent shape, or a
            payload shorter (truncated) or longer (extended) than the header says.
    """
    size = len(buf)
    if size < HEADER_SIZE:
        raise ValueError(f"payload truncated: {size} bytes is shorter than the {HEADER_SIZE}-byte compression header")
    raw = bytes(buf[:HEADER_SIZE])
    known = _READ_HEADERS.get((raw, body_size))
    if known is not None and known.payload_size == size:
        return known  # these very header bytes passed every check below before (a sender's layout repeats)
    header = _read_new_header(raw, size, body_size)
    if len(_READ_HEADERS) >= _READ_HEADERS_MAX:
        _READ_HEADERS.clear()  # a bound, not a policy: a receiver sees a few layouts over and over
    _READ_HEADERS[(raw, body_size)] = header
    return header


_READ_HEADERS: dict[tuple[bytes, Callable[..., int]], PayloadHeader] = {}
"""Headers already read and checked, by their bytes: the checks depend on nothing else (the length is compared)."""
_READ_HEADERS_MAX = 4096


def _read_new_header(raw: bytes, size: int, body_size: Callable[..., int]) -> PayloadHeader:
    (magic, version, kind_code, dtype_code, bits, ndim, value_code, numel, param, *dims) = _HEADER_BODY.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"bad payload magic {magic!r}, expected {MAGIC!r}: not a compression payload")
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported payload format version {version}, this module reads version {FORMAT_VERSION}")
    (crc,) = _HEADER_CRC.unpack_from(raw, _HEADER_BODY.size)
    if crc != zlib.crc32(raw[: _HEADER_BODY.size]):
        raise ValueError("payload header checksum mismatch: the header is garbled")
    try:
        kind = Kind(kind_code)
    except ValueError:
        raise ValueError(
            f"unknown compressor kind code {kind_code} in payload header; known: "
            f"{ {k.name.lower(): int(k) for k in Kind} }"
        ) from None
    if dtype_code not in _CODE_DTYPES:
        raise ValueError(f"unknown source dtype code {dtype_code} in payload header")
    if ndim > MAX_NDIM or any(dims[ndim:]):
        raise ValueError(f"malformed payload header: ndim={ndim}, dims={dims}")
    value_dtype = _CODE_DTYPES.get(value_code)
    if value_dtype not in _VALUE_CODES:
        raise ValueError(
            f"unknown value dtype code {value_code} in payload header; known: "
            f"{ {name: _VALUE_CODES[dtype] for name, dtype in VALUE_DTYPES.items()} }"
        )
    shape = tuple(dims[:ndim])
    if numel == 0 or math.prod(shape) != numel:
        raise ValueError(f"malformed payload header: shape {shape} does not hold numel={numel}")
    expected = HEADER_SIZE + body_size(kind, bits=bits, numel=numel, param=param, value_dtype=value_dtype)
    if size != expected:
        problem = "truncated" if size < expected else "extended"
        raise ValueError(
            f"payload {problem}: header describes a {kind.name.lower()} payload of shape {shape} "
            f"({expected} bytes) but got {size} bytes"
        )
    return PayloadHeader(
        kind=kind,
        source_dtype=_CODE_DTYPES[dtype_code],
        bits=bits,
        shape=shape,
        numel=numel,
        param=param,
        payload_size=expected,
        value_dtype=value_dtype,
    )


def join_payload(header: bytes, *arrays: np.ndarray) -> bytes:
    """One payload: ``header`` followed by the bytes of each array."""
    # bytes.join copies each buffer once straight into the result: no intermediate tobytes().
    return b"".join([header, *(memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays)])


def read_array(buf: memoryview, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    """A writable native-endian copy of ``count`` items of ``dtype`` at ``offset``."""
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).astype(dtype.newbyteorder("="), copy=True)


# -- values in 16 bits ----------------------------------------------------------------------

_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_VALUE_LIMITS: Mapping[torch.dtype, float] = types.MappingProxyType(
    {torch.float16: float(torch.finfo(torch.float16).max), torch.bfloat16: float(torch.finfo(torch.bfloat16).max)}
)


def parse_value_dtype(value: Any, field: str) -> torch.dtype:
    """``value`` (a name of :data:`VALUE_DTYPES` or the torch dtype) as a torch dtype."""
    if isinstance(value, str) and value in VALUE_DTYPES:
        return VALUE_DTYPES[value]
    if isinstance(value, torch.dtype) and value in _VALUE_CODES:
        return value
    raise ValueError(f"{field} must be one of {list(VALUE_DTYPES)}, got {value!r}")


def encode_values(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values -> the little-endian array their ``dtype`` puts on the wire.

    Rounding is to nearest, ties to even. Magnitudes beyond the dtype's largest finite value are
    saturated to it (a float16 gradient of 1e5 travels as 65504), so a send is always finite; error
    feedback keeps the difference like any other rounding.
    """
    if dtype == torch.float32:
        return values.astype(F32, copy=False)
    limit = _VALUE_LIMITS[dtype]
    clipped = np.clip(values, -limit, limit)
    if dtype == torch.float16:
        return clipped.astype(_F16)
    # numpy has no bfloat16: torch rounds, and its bit pattern goes on the wire.
    return (
        torch.from_numpy(clipped).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(_U16, copy=False)
    )


def decode_values(buf: memoryview, dtype: torch.dtype, count: int, offset: int) -> np.ndarray:
    """``count`` values of ``dtype`` at ``offset`` -> a writable native float32 array."""
    if dtype == torch.float32:
        return read_array(buf, F32, count, offset)
    if dtype == torch.float16:
        return np.frombuffer(buf, dtype=_F16, count=count, offset=offset).astype(np.float32)
    # A bfloat16 is the upper half of the float32 with the same value.
    bits = np.frombuffer(buf, dtype=_U16, count=count, offset=offset).astype(np.uint32) << 16
    return bits.view(np.float32)


def value_bits(dtype: torch.dtype) -> int:
    """Bits of one value of ``dtype`` on the wire (the header's ``bits`` for identity and top-k)."""
    return torch.finfo(dtype).bits
