"""Gradient compression: stateless compressors whose output is the exact bytes sent on the wire.

What it is for
--------------
One algorithm module shared by the gRPC parameter server (payloads go straight into a protobuf
``bytes`` field), the DDP communication hooks (``torch.frombuffer(payload, dtype=torch.uint8)``
goes into ``all_gather``) and a user's own training loop. It does no I/O and imports nothing but
torch, numpy and the standard library.

    c = build_compressor("topk", ratio=0.01)           # or "quantization", "identity"
    ef = ErrorFeedback()
    compensated = ef.compensate("fc.weight", grad)     # grad + residual
    payload = c.compress(compensated)                  # bytes; len(payload) is the wire size
    ef.update("fc.weight", compensated, payload)       # residual = compensated - what was sent
    ...                                                # push rejected: ef.rollback("fc.weight")
    dense = decompress(payload)                        # receiver: the header says everything

Every payload is ``HEADER_SIZE`` (56) bytes of fixed header followed by the compressor's buffers:

* ``identity``      4 bytes per entry (raw float32): the uncompressed reference.
* ``topk``          8 bytes per kept entry (float32 value + int32 index),
                    ``k = ceil(ratio * numel)``.
* identity and top-k with ``value_dtype="bfloat16"`` or ``"float16"``: 2 bytes per value, so
                    6 bytes per kept top-k entry (0.75x the float32 payload's body).
* ``quantization``  ``bits / 8`` bytes per entry + one float32 scale per bucket
                    (8 bits: 1 byte per entry, the default).

The layout, costs and algorithms are described in ``docs/compression.md``.

How to tune it
--------------
* ``topk.ratio``: fraction of entries kept. 0.01 sends ~2% of the identity bytes (8 B per kept
  entry against 4 B per entry); pair it with :class:`ErrorFeedback` or training degrades.
* ``topk.selection``: ``"sampled"`` (default) estimates the magnitude threshold from a fixed-seed
  sample and then corrects it, so it returns *exactly the same entries* as ``"exact"``
  (``torch.topk``) but ~9x faster at 1M entries and 15-20x at 11M. Use ``"exact"`` only to
  rule it out.
* ``topk.value_dtype`` / ``identity.value_dtype``: ``"float32"`` (default), ``"bfloat16"`` or
  ``"float16"``: the precision the values travel in. bfloat16 keeps float32's range (7 mantissa
  bits: relative rounding error <= 2**-8); float16 has 10 mantissa bits but saturates at +-65504.
  The rounding error is what :class:`ErrorFeedback` carries into the next step, like the entries
  top-k drops.
* ``topk.sample_size``: sample drawn for the threshold estimate (raised automatically so the
  sample holds at least 256 expected top-k hits). Larger is steadier, smaller is cheaper.
* ``quantization.bits``: 8 (1 B/entry, ~4x), 4 (~8x) or 2 (~16x, ternary). Fewer bits means more
  variance; the QSGD bound is ``E||Q(x)-x||^2 <= min(n/s^2, sqrt(n)/s) ||x||^2`` per bucket of
  ``n`` entries with ``s = 2**(bits-1) - 1`` levels.
* ``quantization.bucket_size``: entries sharing one float32 scale (default 512). Smaller buckets
  cut variance (the scale tracks local magnitude) at 4 bytes per bucket.
* :class:`CompressionPolicy` ``warmup_steps`` sends uncompressed for the first steps and
  ``min_compression_rate`` sends small tensors (biases) uncompressed when compressing would not
  pay for itself.

Inputs in float16, bfloat16 or float64 are converted to float32 before compressing (the header
records the source dtype); :func:`decompress` always returns float32, whatever dtype the values
travelled in. Bad input -- non-finite
values, empty tensors, non-floating dtypes, payloads whose header is garbled or disagrees with the
payload length -- raises ``ValueError`` naming the problem; it never yields a silently wrong tensor.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import numbers
import struct
import sys
import types
import warnings
import zlib
from collections.abc import Hashable, Mapping
from typing import Any, ClassVar, Union

import numpy as np
import torch

__all__ = [
    "BYTES_PER_IDENTITY_ENTRY",
    "BYTES_PER_INDEX",
    "BYTES_PER_SCALE",
    "BYTES_PER_TOPK_ENTRY",
    "COMPRESSORS",
    "CompressionPolicy",
    "Compressor",
    "ErrorFeedback",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "IDENTITY",
    "IdentityCompressor",
    "Kind",
    "MAGIC",
    "MAX_NDIM",
    "PayloadHeader",
    "QuantizationCompressor",
    "TopKCompressor",
    "VALUE_DTYPES",
    "build_compressor",
    "decompress",
    "parse_header",
    "policy_from_config",
    "wire_size",
]

# --------------------------------------------------------------------------------------------
# Wire format
# --------------------------------------------------------------------------------------------

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

_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1

# Little-endian on the wire whatever the host; these are no-op views on little-endian hosts.
_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


class Kind(enum.IntEnum):
    """Compressor kind codes stored in the header; names match the registry keys."""

    IDENTITY = 0
    TOPK = 1
    QUANTIZATION = 2


# Source dtypes accepted by compress(); everything is sent as float32.
_DTYPE_CODES: Mapping[torch.dtype, int] = types.MappingProxyType(
    {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
)
_CODE_DTYPES: Mapping[int, torch.dtype] = types.MappingProxyType({code: dtype for dtype, code in _DTYPE_CODES.items()})
# Dtypes values may travel in (identity and top-k), with the same codes as source dtypes.
VALUE_DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
_VALUE_CODES: Mapping[torch.dtype, int] = types.MappingProxyType(
    {dtype: _DTYPE_CODES[dtype] for dtype in VALUE_DTYPES.values()}
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


def _pack_header(
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
        _DTYPE_CODES[source_dtype],
        bits,
        len(shape),
        _VALUE_CODES[value_dtype],
        numel,
        param,
        *dims,
    )
    return body + _HEADER_CRC.pack(zlib.crc32(body))


def _as_buffer(payload: PayloadLike) -> memoryview:
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


def parse_header(payload: PayloadLike) -> PayloadHeader:
    """Decode and validate the header of ``payload``, including that its length matches.

    Args:
        payload: a payload produced by any compressor's ``compress``.

    Returns:
        The decoded :class:`PayloadHeader`.

    Raises:
        ValueError: bad magic/version/checksum, unknown kind or dtype, inconsistent shape, or a
            payload shorter (truncated) or longer (extended) than the header says.
    """
    buf = _as_buffer(payload)
    return _parse_header(buf)


def _parse_header(buf: memoryview) -> PayloadHeader:
    size = len(buf)
    if size < HEADER_SIZE:
        raise ValueError(f"payload truncated: {size} bytes is shorter than the {HEADER_SIZE}-byte compression header")
    raw = bytes(buf[:HEADER_SIZE])
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
    cls = _BY_KIND[kind]
    cls._check_header(bits=bits, numel=numel, param=param, value_dtype=value_dtype)
    expected = HEADER_SIZE + cls._body_size(bits=bits, numel=numel, param=param)
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


def decompress(
    payload: PayloadLike,
    *,
    device: torch.device | str | None = None,
    copy: bool = True,
    header: PayloadHeader | None = None,
) -> torch.Tensor:
    """Rebuild the dense float32 tensor from any compressor's payload.

    The header names the compressor, so a receiver needs no other information: a push that the
    sender's policy left uncompressed (identity) decodes the same way.

    Args:
        payload: the bytes produced by ``compress`` (or a 1-D uint8 array/tensor view of them).
        device: where to put the result (default CPU).
        copy: ``False`` lets a float32 identity payload come back as a read-only view of
            ``payload``'s values (no copy; the payload must stay alive and nobody may write the tensor):
            what a receiver that only reads the gradient, like the parameter server, wants.
        header: what :func:`parse_header` returned for this very payload, when the caller checked it
            first (a receiver bounding the allocation by the header's shape): it is not parsed twice.

    Returns:
        A float32 tensor of the compressed tensor's shape; new and writable unless ``copy=False``.

    Raises:
        ValueError: the payload is malformed (see :func:`parse_header`) or its buffers are
            (out-of-range indices or codes, non-finite values).
    """
    buf = _as_buffer(payload)
    if header is None:
        header = _parse_header(buf)
    if not copy and header.kind == Kind.IDENTITY and header.value_dtype == torch.float32 and sys.byteorder == "little":
        flat = _identity_view(header, buf)
    else:
        flat = _BY_KIND[header.kind]._decode(header, buf)
    out = flat.reshape(header.shape)
    return out if device is None else out.to(device)


def wire_size(payload: PayloadLike) -> int:
    """Bytes that cross the wire for ``payload``: simply its length (header included)."""
    return len(_as_buffer(payload))


def _join(header: bytes, *arrays: np.ndarray) -> bytes:
    # bytes.join copies each buffer once straight into the result: no intermediate tobytes().
    return b"".join([header, *(memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays)])


# torch.from_numpy warns (once per process) when handed a read-only array; the read-only view of
# decompress(copy=False) is one on purpose.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__.replace(".", r"\.")
)


def _identity_view(header: PayloadHeader, buf: memoryview) -> torch.Tensor:
    """The float32 values of an identity payload as a read-only tensor over ``buf`` (no copy)."""
    values = np.frombuffer(buf, dtype=_F32, count=header.numel, offset=HEADER_SIZE)
    if not _all_finite(values):
        raise ValueError("identity payload holds NaN/Inf values")
    return torch.from_numpy(values)


def _frombuffer(buf: memoryview, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    """A writable native-endian copy of ``count`` items of ``dtype`` at ``offset``."""
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).astype(dtype.newbyteorder("="), copy=True)


# -- values in 16 bits ----------------------------------------------------------------------

_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_VALUE_LIMITS: Mapping[torch.dtype, float] = types.MappingProxyType(
    {torch.float16: float(torch.finfo(torch.float16).max), torch.bfloat16: float(torch.finfo(torch.bfloat16).max)}
)


def _value_dtype(value: Any, field: str) -> torch.dtype:
    """``value`` (a name of :data:`VALUE_DTYPES` or the torch dtype) as a torch dtype."""
    if isinstance(value, str) and value in VALUE_DTYPES:
        return VALUE_DTYPES[value]
    if isinstance(value, torch.dtype) and value in _VALUE_CODES:
        return value
    raise ValueError(f"{field} must be one of {list(VALUE_DTYPES)}, got {value!r}")


def _encode_values(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values -> the little-endian array their ``dtype`` puts on the wire.

    Rounding is to nearest, ties to even. Magnitudes beyond the dtype's largest finite value are
    saturated to it (a float16 gradient of 1e5 travels as 65504), so a send is always finite; error
    feedback keeps the difference like any other rounding.
    """
    if dtype == torch.float32:
        return values.astype(_F32, copy=False)
    limit = _VALUE_LIMITS[dtype]
    clipped = np.clip(values, -limit, limit)
    if dtype == torch.float16:
        return clipped.astype(_F16)
    # numpy has no bfloat16: torch rounds, and its bit pattern goes on the wire.
    return (
        torch.from_numpy(clipped).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(_U16, copy=False)
    )


def _decode_values(buf: memoryview, dtype: torch.dtype, count: int, offset: int) -> np.ndarray:
    """``count`` values of ``dtype`` at ``offset`` -> a writable native float32 array."""
    if dtype == torch.float32:
        return _frombuffer(buf, _F32, count, offset)
    if dtype == torch.float16:
        return np.frombuffer(buf, dtype=_F16, count=count, offset=offset).astype(np.float32)
    # A bfloat16 is the upper half of the float32 with the same value.
    bits = np.frombuffer(buf, dtype=_U16, count=count, offset=offset).astype(np.uint32) << 16
    return bits.view(np.float32)


def _value_bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _prepare_input(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype]:
    """Validate a tensor to compress; return it flat, float32, contiguous (a view when possible).

    Finiteness is checked later, fused into each compressor's own pass over the values.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"compress expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"compress expects a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"compress expects a floating-point tensor (float32, float16, bfloat16 or float64), "
            f"got dtype {tensor.dtype}"
        )
    if tensor.numel() == 0:
        raise ValueError(f"cannot compress an empty tensor (shape {tuple(tensor.shape)})")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot compress a tensor with {len(shape)} dimensions; the header holds at most {MAX_NDIM}")
    if max(shape, default=1) > _UINT32_MAX:
        raise ValueError(f"cannot compress shape {shape}: each dimension must be < 2**32")
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
    return flat, shape, tensor.dtype


def _raise_non_finite(flat: torch.Tensor, shape: tuple[int, ...], source_dtype: torch.dtype) -> None:
    nans, infs = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    extra = "" if source_dtype == torch.float32 else " (after conversion to float32)"
    raise ValueError(
        f"cannot compress a tensor of shape {shape} holding non-finite values: {nans} NaN and {infs} Inf{extra}"
    )


def _all_finite(values: Union[np.ndarray, torch.Tensor]) -> bool:
    # One pass: NaN and +-Inf make the sum non-finite, so a finite sum proves every value finite.
    # Finite values can also overflow the sum; only then does the exact check (min/max) decide.
    if isinstance(values, torch.Tensor):
        if math.isfinite(values.sum().item()):
            return True
        lo, hi = torch.aminmax(values)
        return math.isfinite(lo.item()) and math.isfinite(hi.item())
    with np.errstate(over="ignore", invalid="ignore"):
        total = values.sum()
    return bool(np.isfinite(total)) or (math.isfinite(values.min()) and math.isfinite(values.max()))


def _use_host_path(flat: torch.Tensor) -> bool:
    """CPU tensors are compressed with single-threaded numpy kernels.

    torch's intra-op thread pool parallelises each elementwise op; when the cores are shared
    (DDP ranks, data loaders, the PS process) every op then waits on a descheduled thread,
    which made 8-bit quantization of 11M entries 10-20x slower (600-1400 ms instead of 70).
    numpy on cache-sized chunks is about as fast on an idle machine and only slows by the CPU
    share it loses. Tensors on accelerators keep torch kernels. (Tests switch this off to run
    the torch path on CPU.)
    """
    return flat.device.type == "cpu"


def _resolve_generator(
    generator: torch.Generator | None, seed: int | None, device: torch.device
) -> torch.Generator | None:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to compress, not both")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None:
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


def _check_numel(numel: Any) -> int:
    if not isinstance(numel, numbers.Integral) or isinstance(numel, bool) or numel <= 0:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    return int(numel)


# --------------------------------------------------------------------------------------------
# Compressors
# --------------------------------------------------------------------------------------------


class Compressor(abc.ABC):
    """Interface shared by every compressor: stateless, the payload is the wire message.

    Subclasses are frozen dataclasses whose fields are their configuration; the registry name
    is ``name`` and the header code ``kind``.
    """

    name: ClassVar[str]
    kind: ClassVar[Kind]

    def compress(
        self, tensor: torch.Tensor, generator: torch.Generator | None = None, *, seed: int | None = None
    ) -> bytes:
        """Compress ``tensor`` into the bytes to send.

        Args:
            tensor: a dense floating tensor (float16/bfloat16/float64 are converted to float32).
            generator: RNG for stochastic compressors (quantization), on the tensor's device;
                default: torch's global RNG. Deterministic compressors ignore it.
            seed: alternative to ``generator``: seeds a fresh generator for this call.

        Returns:
            The payload: fixed header + buffers. ``len(payload)`` is the wire size and equals
            ``self.wire_size_for(tensor.numel())``.

        Raises:
            ValueError: non-tensor, non-floating dtype, empty tensor, NaN/Inf values, more than
                ``MAX_NDIM`` dimensions.
        """
        flat, shape, source_dtype = _prepare_input(tensor)
        gen = _resolve_generator(generator, seed, flat.device)
        return self._encode(flat, shape, source_dtype, gen)

    def decompress(self, payload: PayloadLike, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense float32 tensor from a payload; same as the module-level :func:`decompress`.

        The header is authoritative, so this also decodes payloads of other kinds (e.g. the
        identity payloads a :class:`CompressionPolicy` sends during warm-up).
        """
        return decompress(payload, device=device)

    def wire_size_for(self, numel: int) -> int:
        """Exact payload length in bytes (header included) for a tensor of ``numel`` entries.

        It depends on the configuration and ``numel`` only, so every DDP rank's payload for a
        bucket has the same length and ``all_gather`` needs no padding.
        """
        numel = _check_numel(numel)
        return HEADER_SIZE + self._body_size(bits=self._bits(), numel=numel, param=self._param(numel))

    def compression_rate(self, numel: int) -> float:
        """Identity wire bytes / this compressor's wire bytes for ``numel`` entries."""
        return IDENTITY.wire_size_for(numel) / self.wire_size_for(numel)

    # -- subclass hooks --------------------------------------------------------------------

    @abc.abstractmethod
    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], source_dtype: torch.dtype, generator: torch.Generator | None
    ) -> bytes:
        raise NotImplementedError

    @abc.abstractmethod
    def _bits(self) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def _param(self, numel: int) -> int:
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _check_header(cls, *, bits: int, numel: int, param: int, value_dtype: torch.dtype) -> None:
        """Raise ValueError when header fields are impossible for this kind."""
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _body_size(cls, *, bits: int, numel: int, param: int) -> int:
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _decode(cls, header: PayloadHeader, buf: memoryview) -> torch.Tensor:
        """Flat float32 CPU tensor of ``header.numel`` entries from a length-checked payload."""
        raise NotImplementedError


def _check_value_bits(kind: str, bits: int, value_dtype: torch.dtype) -> None:
    if bits != _value_bits(value_dtype):
        raise ValueError(f"malformed {kind} payload header: bits={bits} for {value_dtype} values")


@dataclasses.dataclass(frozen=True)
class IdentityCompressor(Compressor):
    """Every value, uncompressed: 4 bytes per entry (float32, the reference) or 2 (16-bit values).

    Attributes:
        value_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"`` (or the torch dtype).
    """

    name: ClassVar[str] = "identity"
    kind: ClassVar[Kind] = Kind.IDENTITY

    value_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        object.__setattr__(self, "value_dtype", _value_dtype(self.value_dtype, "identity.value_dtype"))

    def _encode(self, flat, shape, source_dtype, generator):
        values = flat.cpu().numpy()
        if not _all_finite(values):
            _raise_non_finite(flat, shape, source_dtype)
        header = _pack_header(self.kind, source_dtype, self._bits(), shape, flat.numel(), 0, self.value_dtype)
        return _join(header, _encode_values(values, self.value_dtype))

    def _bits(self) -> int:
        return _value_bits(self.value_dtype)

    def _param(self, numel: int) -> int:
        return 0

    @classmethod
    def _check_header(cls, *, bits, numel, param, value_dtype):
        _check_value_bits("identity", bits, value_dtype)
        if param != 0:
            raise ValueError(f"malformed identity payload header: bits={bits}, param={param}")

    @classmethod
    def _body_size(cls, *, bits, numel, param):
        return bits // 8 * numel

    @classmethod
    def _decode(cls, header, buf):
        values = _decode_values(buf, header.value_dtype, header.numel, HEADER_SIZE)
        if not _all_finite(values):
            raise ValueError("identity payload holds NaN/Inf values")
        return torch.from_numpy(values)


#: The shared identity compressor (stateless, so one instance serves everybody).
IDENTITY = IdentityCompressor()

# -- top-k selection ------------------------------------------------------------------------

_SELECTIONS = ("exact", "sampled")
_SAMPLE_SEED = 0x5EED  # fixed: the estimate (and so the speed) is reproducible run to run
_MIN_SAMPLE_HITS = 256  # expected top-k members in the sample; sets the estimate's noise
_SAMPLE_SIGMAS = 4.0  # safety margin of the first threshold, in binomial std of the hits
_SAMPLE_ATTEMPTS = 3  # threshold estimates tried before falling back to torch.topk
_SCAN_CHUNK_ENTRIES = 1 << 18  # entries per step of host scans (1 MB of float32: cache-sized)


def _sample_plan(numel: int, k: int, sample_size: int) -> tuple[int, int] | None:
    """(sample size, rank of the first threshold in the sample), or None: select exactly."""
    size = max(sample_size, math.ceil(_MIN_SAMPLE_HITS * numel / k))
    if 4 * size > numel:
        return None  # sampling cannot beat one pass over a tensor this small (or a k this large)
    hits = size * k / numel  # expected sample entries inside the true top-k
    return size, math.ceil(hits + _SAMPLE_SIGMAS * math.sqrt(hits)) + 1


def _lower_threshold_rank(rank: int, k: int, num_candidates: int) -> int:
    # Too few candidates: lower the threshold, aiming at twice the observed shortfall.
    return math.ceil(2 * rank * k / max(1, num_candidates)) + 1


def _host_first_k(magnitudes: np.ndarray, kth: np.float32, k: int) -> np.ndarray:
    """Positions of every entry > ``kth`` plus the lowest-index entries == ``kth``, up to ``k``.

    ``kth`` is the k-th largest value of ``magnitudes``, so exactly ``k`` ascending positions
    come back. This is the deterministic tie rule: among equal magnitudes the lower index wins
    (``torch.topk`` itself leaves that order unspecified).
    """
    selected = magnitudes > kth
    missing = k - int(np.count_nonzero(selected))
    if missing > 0:
        selected[np.flatnonzero(magnitudes == kth)[:missing]] = True
    return np.flatnonzero(selected)


def _host_exact_topk(values: np.ndarray, k: int) -> np.ndarray | None:
    """Exact top-k positions via torch.topk; None if ``values`` holds NaN/Inf."""
    magnitudes = np.abs(values)
    if not math.isfinite(magnitudes.max()):
        return None
    kth = torch.topk(torch.from_numpy(magnitudes), k, sorted=False).values.min().numpy()
    return _host_first_k(magnitudes, kth, k)


def _host_scan(values: np.ndarray, threshold: np.float32) -> np.ndarray | None:
    """Ascending positions with ``|x| >= threshold``; None if ``values`` holds NaN/Inf.

    Cache-sized chunks with reused scratch buffers: no full-size temporaries, whose page faults
    would cost more than the arithmetic. The finiteness check rides along for free.
    """
    chunk = min(values.size, _SCAN_CHUNK_ENTRIES)
    magnitudes = np.empty(chunk, dtype=np.float32)
    mask = np.empty(chunk, dtype=np.bool_)
    parts = []
    for start in range(0, values.size, chunk):
        block = values[start : start + chunk]
        mags, hits = magnitudes[: block.size], mask[: block.size]
        np.abs(block, out=mags)
        if not math.isfinite(mags.max()):
            return None
        np.greater_equal(mags, threshold, out=hits)
        positions = np.flatnonzero(hits)
        if start:
            positions += start
        parts.append(positions)
    return np.concatenate(parts)


def _host_sampled_topk(values: np.ndarray, k: int, sample_size: int) -> np.ndarray | None:
    """Top-k positions from a sampled threshold; None: use the exact path instead."""
    plan = _sample_plan(values.size, k, sample_size)
    if plan is None:
        return None
    size, rank = plan
    picks = np.random.default_rng(_SAMPLE_SEED).integers(0, values.size, size)
    sample = np.abs(values[picks])
    for _ in range(_SAMPLE_ATTEMPTS):
        rank = max(1, min(rank, size))
        threshold = np.partition(sample, size - rank)[size - rank]  # rank-th largest
        if not threshold > 0:
            return None  # mostly zeros (every entry a candidate) or NaN in the sample
        candidates = _host_scan(values, threshold)
        if candidates is None:
            return None  # non-finite values: the exact path reports them
        if candidates.size >= k:
            # Every entry with |x| >= threshold is a candidate and there are >= k of them, so
            # the true k-th largest is >= threshold: the candidates hold the exact top-k.
            magnitudes = np.abs(values[candidates])
            kth = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
            return candidates[_host_first_k(magnitudes, kth, k)]
        if rank == size:
            return None
        rank = _lower_threshold_rank(rank, k, candidates.size)
    return None


def _device_first_k(magnitudes: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """torch twin of :func:`_host_first_k` for tensors on accelerators."""
    selected = magnitudes > kth
    missing = k - int(torch.count_nonzero(selected))
    if missing > 0:
        selected[(magnitudes == kth).nonzero().squeeze(1)[:missing]] = True
    return selected.nonzero().squeeze(1)


def _device_exact_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    magnitudes = flat.abs()
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    return _device_first_k(magnitudes, kth, k)


def _device_sampled_topk(flat: torch.Tensor, k: int, sample_size: int) -> torch.Tensor:
    """torch twin of :func:`_host_sampled_topk` (falls back to exact itself)."""
    plan = _sample_plan(flat.numel(), k, sample_size)
    if plan is None:
        return _device_exact_topk(flat, k)
    size, rank = plan
    gen = torch.Generator(device=flat.device).manual_seed(_SAMPLE_SEED)
    picks = torch.randint(flat.numel(), (size,), generator=gen, device=flat.device)
    sample = flat.index_select(0, picks).abs_()
    for _ in range(_SAMPLE_ATTEMPTS):
        rank = max(1, min(rank, size))
        threshold = torch.kthvalue(sample, size - rank + 1).values
        if not threshold.item() > 0:
            break
        candidates = (flat.abs() >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            magnitudes = flat.index_select(0, candidates).abs_()
            kth = torch.kthvalue(magnitudes, magnitudes.numel() - k + 1).values
            return candidates[_device_first_k(magnitudes, kth, k)]
        if rank == size:
            break
        rank = _lower_threshold_rank(rank, k, candidates.numel())
    return _device_exact_topk(flat, k)


@dataclasses.dataclass(frozen=True)
class TopKCompressor(Compressor):
    """Keep the ``ceil(ratio * numel)`` entries of largest magnitude.

    Wire: header + ``k`` values + ``k`` int32 indices (8 bytes per kept entry with float32
    values, 6 with 16-bit ones), indices ascending. Ties in magnitude: the lower index wins, in
    both selection modes. Selection looks at the float32 magnitudes; only the kept values are
    rounded to ``value_dtype``.

    Attributes:
        ratio: fraction of entries kept, in (0, 1]. ``k = ceil(ratio * numel)`` with
            ``ratio * numel`` rounded to 6 decimals first so that binary error cannot add an
            entry (0.07 * 100 -> 7, not 8); at least 1.
        selection: ``"exact"``: ``torch.topk`` over all magnitudes. ``"sampled"``: threshold
            estimated from a fixed-seed sample, candidates ``|x| >= threshold`` collected, and the
            exact k-th largest found among the candidates only (the threshold is lowered and
            retried, finally falling back to exact, if fewer than k candidates turn up). Both
            modes return identical payloads; ``"sampled"`` is faster on large tensors.
        sample_size: minimum sample drawn by ``"sampled"`` selection.
        value_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"`` (or the torch
            dtype): what the kept values travel in.
    """

    name: ClassVar[str] = "topk"
    kind: ClassVar[Kind] = Kind.TOPK

    ratio: float = 0.01
    selection: str = "sampled"
    sample_size: int = 65536
    value_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        ratio = self.ratio
        if (
            not isinstance(ratio, numbers.Real)
            or isinstance(ratio, bool)
            or not math.isfinite(ratio)
            or not 0 < ratio <= 1
        ):
            raise ValueError(f"topk.ratio must be a number in (0, 1], got {ratio!r}")
        if self.selection not in _SELECTIONS:
            raise ValueError(f"topk.selection must be one of {list(_SELECTIONS)}, got {self.selection!r}")
        if (
            not isinstance(self.sample_size, numbers.Integral)
            or isinstance(self.sample_size, bool)
            or self.sample_size < 1024
        ):
            raise ValueError(f"topk.sample_size must be an int >= 1024, got {self.sample_size!r}")
        object.__setattr__(self, "ratio", float(ratio))
        object.__setattr__(self, "value_dtype", _value_dtype(self.value_dtype, "topk.value_dtype"))

    def k_for(self, numel: int) -> int:
        """Entries kept for a tensor of ``numel`` entries."""
        numel = _check_numel(numel)
        return min(numel, max(1, math.ceil(round(self.ratio * numel, 6))))

    def _encode(self, flat, shape, source_dtype, generator):
        numel = flat.numel()
        if numel > _INT32_MAX:
            raise ValueError(f"top-k indices are int32: cannot compress {numel} entries (more than {_INT32_MAX})")
        k = self.k_for(numel)
        if _use_host_path(flat):
            values = flat.numpy()
            indices = None
            if self.selection == "sampled":
                indices = _host_sampled_topk(values, k, self.sample_size)
            if indices is None:
                indices = _host_exact_topk(values, k)
            if indices is None:
                _raise_non_finite(flat, shape, source_dtype)
            kept = values[indices]
        else:
            if not _all_finite(flat):
                _raise_non_finite(flat, shape, source_dtype)
            if self.selection == "sampled":
                selected = _device_sampled_topk(flat, k, self.sample_size)
            else:
                selected = _device_exact_topk(flat, k)
            kept = flat.index_select(0, selected).cpu().numpy()
            indices = selected.cpu().numpy()
        header = _pack_header(self.kind, source_dtype, self._bits(), shape, numel, k, self.value_dtype)
        return _join(header, _encode_values(kept, self.value_dtype), indices.astype(_I32))

    def _bits(self) -> int:
        return _value_bits(self.value_dtype)

    def _param(self, numel: int) -> int:
        return self.k_for(numel)

    @classmethod
    def _check_header(cls, *, bits, numel, param, value_dtype):
        _check_value_bits("topk", bits, value_dtype)
        if not 1 <= param <= numel or numel > _INT32_MAX:
            raise ValueError(f"malformed topk payload header: bits={bits}, k={param}, numel={numel}")

    @classmethod
    def _body_size(cls, *, bits, numel, param):
        return (bits // 8 + BYTES_PER_INDEX) * param

    @classmethod
    def _decode(cls, header, buf):
        k, numel = header.param, header.numel
        values = _decode_values(buf, header.value_dtype, k, HEADER_SIZE)
        indices = _frombuffer(buf, _I32, k, HEADER_SIZE + header.bits // 8 * k)
        if not _all_finite(values):
            raise ValueError("topk payload holds NaN/Inf values")
        if indices[0] < 0 or indices[-1] >= numel or (k > 1 and not (np.diff(indices) > 0).all()):
            raise ValueError(
                f"topk payload indices are not strictly increasing within [0, {numel}): the buffers are garbled"
            )
        out = np.zeros(numel, dtype=np.float32)  # calloc'd: pages are zeroed on first touch
        out[indices] = values
        return torch.from_numpy(out)


# -- quantization ---------------------------------------------------------------------------

_QUANT_BITS = (2, 4, 8)
# Rows per step ~ 256K entries: the temporaries stay cache-resident and are reused, ~3x faster
# than whole-tensor temporaries (page faults dominate those).
_QUANT_CHUNK_ENTRIES = 1 << 18


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


@dataclasses.dataclass(frozen=True)
class QuantizationCompressor(Compressor):
    """QSGD-style stochastic quantization with one float32 scale (max ``|x|``) per bucket.

    Each entry becomes a signed code ``q`` in ``[-s, s]``, ``s = 2**(bits-1) - 1``, with
    ``|x| / scale * s`` rounded up or down at random so that ``E[q * scale / s] = x`` (unbiased
    up to the 2**-24 granularity of the uniform draws). 8 bits: int8 codes, 1 byte per entry;
    4 bits: ``q + 7`` in two nibbles per byte (low nibble first); 2 bits: ``q + 1`` in four
    2-bit fields per byte (lowest bits first). Scales come first, then the codes.

    Attributes:
        bits: 2, 4 or 8.
        bucket_size: entries per scale; the last bucket may be partial.
    """

    name: ClassVar[str] = "quantization"
    kind: ClassVar[Kind] = Kind.QUANTIZATION

    bits: int = 8
    bucket_size: int = 512

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in _QUANT_BITS:
            raise ValueError(f"quantization.bits must be one of {list(_QUANT_BITS)}, got {self.bits!r}")
        size = self.bucket_size
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or not 0 < size <= _UINT32_MAX:
            raise ValueError(f"quantization.bucket_size must be a positive int (< 2**32), got {size!r}")
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "bucket_size", int(size))

    @property
    def levels(self) -> int:
        """Magnitude levels ``s``: 127, 7 or 1."""
        return _levels(self.bits)

    def num_buckets(self, numel: int) -> int:
        """Buckets (and so float32 scales) for a tensor of ``numel`` entries."""
        return -(-_check_numel(numel) // self.bucket_size)

    def _encode(self, flat, shape, source_dtype, generator):
        numel, size = flat.numel(), self.bucket_size
        if _use_host_path(flat):
            scales, codes = _host_quantize(flat.numpy(), size, self.levels, generator)
        else:
            scales, codes = _device_quantize(flat, size, self.levels, generator)
        if not np.isfinite(scales).all():  # a bucket's max |x| is NaN/Inf iff it holds one
            _raise_non_finite(flat, shape, source_dtype)
        header = _pack_header(self.kind, source_dtype, self.bits, shape, numel, size)
        return _join(header, scales.astype(_F32, copy=False), _pack_codes(codes, self.bits))

    def _bits(self) -> int:
        return self.bits

    def _param(self, numel: int) -> int:
        return self.bucket_size

    @classmethod
    def _check_header(cls, *, bits, numel, param, value_dtype):
        if bits not in _QUANT_BITS or param == 0 or value_dtype != torch.float32:
            raise ValueError(
                f"malformed quantization payload header: bits={bits}, "
                f"bucket_size={param}, value dtype {value_dtype} (scales are float32)"
            )

    @classmethod
    def _body_size(cls, *, bits, numel, param):
        per_byte = 8 // bits
        return BYTES_PER_SCALE * -(-numel // param) + -(-numel // per_byte)

    @classmethod
    def _decode(cls, header, buf):
        numel, size, bits = header.numel, header.param, header.bits
        num_buckets = -(-numel // size)
        scales = _frombuffer(buf, _F32, num_buckets, HEADER_SIZE)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("quantization payload holds negative or non-finite scales")
        out = _unpack_codes(buf, HEADER_SIZE + BYTES_PER_SCALE * num_buckets, numel, bits)
        step = scales / np.float32(_levels(bits))
        full = numel // size
        if full:
            out[: full * size].reshape(full, size)[...] *= step[:full, None]
        if full * size < numel:
            out[full * size :] *= step[full]
        return torch.from_numpy(out)


def _host_quantize(
    values: np.ndarray, size: int, levels: int, generator: torch.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket scales and int8 codes of ``values`` (numpy, cache-sized chunks of buckets)."""
    numel = values.size
    full = numel // size
    scales = np.empty(-(-numel // size), dtype=np.float32)
    codes = np.empty(numel, dtype=np.int8)
    if full:
        _host_quantize_rows(
            values[: full * size].reshape(full, size),
            levels,
            generator,
            scales[:full],
            codes[: full * size].reshape(full, size),
        )
    if full * size < numel:
        _host_quantize_rows(
            values[full * size :].reshape(1, -1), levels, generator, scales[full:], codes[full * size :].reshape(1, -1)
        )
    return scales, codes


def _host_quantize_rows(
    rows: np.ndarray, levels: int, generator: torch.Generator | None, scales_out: np.ndarray, codes_out: np.ndarray
) -> None:
    num_rows, width = rows.shape
    step_rows = max(1, _QUANT_CHUNK_ENTRIES // width)
    chunk = min(num_rows, step_rows)
    scaled = np.empty((chunk, width), dtype=np.float32)
    floor = np.empty_like(scaled)
    uniform = np.empty_like(scaled)
    uniform_torch = torch.from_numpy(uniform)  # torch's RNG fills numpy's buffer in place
    round_up = np.empty((chunk, width), dtype=np.bool_)
    for start in range(0, num_rows, step_rows):
        block = rows[start : start + step_rows]
        n = block.shape[0]
        y, low, u, up = scaled[:n], floor[:n], uniform[:n], round_up[:n]
        # Row max/min without an abs() temporary; NaN propagates, so scales reveal it.
        scale = np.maximum(block.max(axis=1), -block.min(axis=1))
        scales_out[start : start + n] = scale
        if not np.isfinite(scale).all():
            return  # NaN/Inf input: the caller sees it in the scales and raises
        # Divide, then multiply: a denormal scale cannot overflow (levels / scale could be inf).
        np.divide(block, np.where(scale > 0, scale, np.float32(1))[:, None], out=y)
        y *= np.float32(levels)
        np.clip(y, -levels, levels, out=y)  # IEEE division keeps |y| <= levels; int8 insurance
        np.floor(y, out=low)
        y -= low  # fractional part in [0, 1): the probability of rounding up
        uniform_torch[:n].uniform_(generator=generator)
        np.less(u, y, out=up)
        low += up
        np.copyto(codes_out[start : start + n], low, casting="unsafe")


def _device_quantize(
    flat: torch.Tensor, size: int, levels: int, generator: torch.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """torch twin of :func:`_host_quantize` for tensors on accelerators (one shot, padded)."""
    numel = flat.numel()
    num_buckets = -(-numel // size)
    padded = flat.new_zeros(num_buckets * size)
    padded[:numel] = flat
    rows = padded.view(num_buckets, size)
    scale = rows.abs().amax(dim=1)
    y = rows / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    y.mul_(levels).clamp_(-levels, levels)
    low = y.floor()
    up = torch.rand(rows.shape, generator=generator, device=rows.device) < (y - low)
    codes = low.add_(up).to(torch.int8).view(-1)[:numel]
    return scale.cpu().numpy(), codes.cpu().numpy()


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """int8 codes in [-s, s] -> the uint8 wire bytes for ``bits``."""
    if bits == 8:
        return codes.view(np.uint8)
    per_byte = 8 // bits
    shifted = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    np.add(codes, _levels(bits), out=shifted[: codes.size], casting="unsafe")  # 0..2s
    fields = shifted.reshape(-1, per_byte)
    packed = fields[:, 0].copy()
    for j in range(1, per_byte):
        packed |= fields[:, j] << (bits * j)
    return packed


def _unpack_table(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """For every byte value: its ``8 // bits`` float32 codes, and whether all are in range."""
    per_byte, mask, levels = 8 // bits, (1 << bits) - 1, _levels(bits)
    byte = np.arange(256)
    fields = np.stack([(byte >> (bits * j)) & mask for j in range(per_byte)], axis=1)
    return (fields - levels).astype(np.float32), (fields <= 2 * levels).all(axis=1)


# One table lookup per byte decodes all its fields at once: ~3x faster than shift-and-mask.
_UNPACK_TABLES = types.MappingProxyType({bits: _unpack_table(bits) for bits in (2, 4)})


def _unpack_codes(buf: memoryview, offset: int, numel: int, bits: int) -> np.ndarray:
    """Wire bytes -> writable float32 codes in [-s, s]; rejects codes outside that range."""
    if bits == 8:
        raw = np.frombuffer(buf, dtype=np.int8, count=numel, offset=offset)
        if raw.min() < -_levels(8):
            raise ValueError("quantization payload holds an out-of-range 8-bit code (-128)")
        return raw.astype(np.float32)
    per_byte = 8 // bits
    raw = np.frombuffer(buf, dtype=np.uint8, count=-(-numel // per_byte), offset=offset)
    table, valid = _UNPACK_TABLES[bits]
    if not np.take(valid, raw).all():
        raise ValueError(f"quantization payload holds an out-of-range {bits}-bit code")
    return np.take(table, raw, axis=0).reshape(-1)[:numel]


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

#: Compressor classes by registry name (read-only).
COMPRESSORS: Mapping[str, type[Compressor]] = types.MappingProxyType(
    {cls.name: cls for cls in (IdentityCompressor, TopKCompressor, QuantizationCompressor)}
)
_BY_KIND: Mapping[Kind, type[Compressor]] = types.MappingProxyType({cls.kind: cls for cls in COMPRESSORS.values()})


def _check_registry() -> None:
    """Every Kind has exactly one compressor, named after it, and vice versa."""
    expected = {kind.name.lower(): kind for kind in Kind}
    actual = {name: cls.kind for name, cls in COMPRESSORS.items()}
    if actual != expected or len(_BY_KIND) != len(COMPRESSORS):
        raise RuntimeError(f"compressor registry incomplete: expected {expected}, got {actual}")


_check_registry()


def build_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build a compressor from its registry name and config-like keyword arguments.

    Args:
        name: ``"identity"``, ``"topk"`` or ``"quantization"``.
        **kwargs: that compressor's fields: topk: ``ratio``, ``selection``, ``sample_size``;
            quantization: ``bits``, ``bucket_size``; identity: none.

    Returns:
        The (stateless, immutable) compressor.

    Raises:
        ValueError: unknown name, unknown keyword, or an invalid value (the message names the
            field, e.g. ``topk.ratio``).
    """
    cls = COMPRESSORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(COMPRESSORS)}")
    accepted = [field.name for field in dataclasses.fields(cls) if field.init]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for compressor {name!r}; accepted: {accepted or 'none'}")
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Warm-up and skipping
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompressionPolicy:
    """Chooses per send between the configured compressor and identity.

    Identity is used while ``step < warmup_steps`` (dense updates early in training, as PowerSGD
    does) and for tensors the compressor would not shrink enough: the compressor is used only
    when identity's payload is more than ``min_compression_rate`` times the compressor's. With
    the default 1.0 that means "skip only when compressing would not make the payload smaller"
    (tiny biases, whose 56-byte header dominates). That identity sends its values in the
    compressor's ``value_dtype`` (float32 for quantization), so a run that asks for 16-bit values
    gets them in every payload. Receivers decode either with :func:`decompress`.

    Attributes:
        compressor: the compressor used after warm-up.
        warmup_steps: number of initial steps (0-based ``step < warmup_steps``) sent uncompressed.
        min_compression_rate: identity bytes / compressed bytes the compressor must beat.
    """

    compressor: Compressor
    warmup_steps: int = 0
    min_compression_rate: float = 1.0

    def __post_init__(self):
        if not isinstance(self.compressor, Compressor):
            raise ValueError(f"policy.compressor must be a Compressor, got {type(self.compressor).__name__}")
        steps = self.warmup_steps
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"policy.warmup_steps must be an int >= 0, got {steps!r}")
        rate = self.min_compression_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"policy.min_compression_rate must be a finite number >= 0, got {rate!r}")

    @property
    def identity(self) -> IdentityCompressor:
        """What goes uncompressed: identity in the compressor's value dtype."""
        value_dtype = getattr(self.compressor, "value_dtype", torch.float32)
        return IDENTITY if value_dtype == torch.float32 else IdentityCompressor(value_dtype)

    def compressor_for(self, step: int, numel: int) -> Compressor:
        """The compressor to use at ``step`` for a tensor of ``numel`` entries."""
        identity = self.identity
        if step < self.warmup_steps:
            return identity
        if identity.wire_size_for(numel) / self.compressor.wire_size_for(numel) <= self.min_compression_rate:
            return identity
        return self.compressor

    def compress(
        self, tensor: torch.Tensor, step: int, generator: torch.Generator | None = None, *, seed: int | None = None
    ) -> bytes:
        """Compress ``tensor`` with :meth:`compressor_for` ``(step, tensor.numel())``."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"compress expects a torch.Tensor, got {type(tensor).__name__}")
        numel = tensor.numel()
        chosen = self.compressor_for(step, numel) if numel else self.compressor
        return chosen.compress(tensor, generator, seed=seed)

    @staticmethod
    def decompress(payload: PayloadLike, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Same as the module-level :func:`decompress`."""
        return decompress(payload, device=device)


# Config field names that configure each compressor, read from a ``system`` config section.
_SETTINGS_FROM_CONFIG: Mapping[str, Any] = types.MappingProxyType(
    {
        "topk": lambda system: {
            "ratio": system.compression_ratio,
            "selection": system.topk_selection,
            # a section from before 16-bit values existed reads as float32
            "value_dtype": getattr(system, "compression_value_dtype", "float32"),
        },
        "quantization": lambda system: {
            "bits": system.quantization_bits,
            "bucket_size": system.quantization_bucket_size,
        },
    }
)


def policy_from_config(system: Any) -> "CompressionPolicy | None":
    """The compression a run's ``system`` config section asks for, or ``None`` when disabled.

    ``system`` is read by attribute (``src.config.SystemConfig``: ``compression_enabled``,
    ``compression_type``, ``compression_ratio``, ``topk_selection``, ``compression_value_dtype``,
    ``quantization_bits``, ``quantization_bucket_size``, ``warmup_steps``), so this module stays
    free of the config layer.

    Raises:
        ValueError: unknown ``compression_type`` or a bad setting (naming the field).
    """
    if not system.compression_enabled:
        return None
    try:
        settings = _SETTINGS_FROM_CONFIG[system.compression_type](system)
    except KeyError:
        raise ValueError(
            f"system.compression_type: must be one of {sorted(_SETTINGS_FROM_CONFIG)}, got {system.compression_type!r}"
        ) from None
    compressor = build_compressor(system.compression_type, **settings)
    return CompressionPolicy(compressor, warmup_steps=system.warmup_steps)


# --------------------------------------------------------------------------------------------
# Error feedback
# --------------------------------------------------------------------------------------------

_EF_STATE_VERSION = 1


def _check_key(key: Hashable) -> None:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise ValueError(f"error-feedback key must be a str or int (parameter name or bucket index), got {key!r}")


def _float_tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} must be a floating-point torch.Tensor, got {kind}")
    return value.detach().to(torch.float32)


class ErrorFeedback:
    """Per-key residuals: what compression left out is added back to the next gradient.

    Use per parameter (key = name) or per DDP bucket (key = bucket index)::

        compensated = ef.compensate(key, grad)        # grad + residual
        payload = compressor.compress(compensated)
        ef.update(key, compensated, payload)          # residual = compensated - sent
        # push rejected (e.g. too stale)?  ef.rollback(key): residual = compensated, nothing lost
        # push accepted?  optionally ef.commit(key) to drop the rollback copy early

    Invariant: after T steps, sum(transmitted) + residual == sum(gradients), and a rollback
    restores the residual to exactly the compensated tensor. ``update`` keeps a reference to
    ``compensated`` for the rollback, so do not modify it in place until the next
    ``update``/``rollback``/``commit`` of that key (``compensate`` always returns a fresh tensor).
    Residuals live on the device of the gradients they came from.
    """

    def __init__(self) -> None:
        self._residuals: dict[Union[str, int], torch.Tensor] = {}
        self._pending: dict[Union[str, int], torch.Tensor] = {}
        self._before: dict[Union[str, int], torch.Tensor | None] = {}

    def compensate(self, key: Union[str, int], grad: torch.Tensor) -> torch.Tensor:
        """Return a new float32 tensor ``grad + residual(key)`` (``grad`` copy if none yet).

        Raises:
            ValueError: bad key, non-floating grad, or a shape that differs from the residual's.
        """
        _check_key(key)
        grad = _float_tensor(grad, f"gradient for key {key!r}")
        residual = self._residuals.get(key)
        if residual is None:
            return grad.clone()
        if residual.shape != grad.shape:
            raise ValueError(
                f"gradient for key {key!r} has shape {tuple(grad.shape)} but its "
                f"residual has shape {tuple(residual.shape)}"
            )
        return grad + residual.to(grad.device)

    def update(
        self, key: Union[str, int], compensated: torch.Tensor, transmitted: Union[PayloadLike, torch.Tensor]
    ) -> torch.Tensor:
        """Record what was sent: residual = compensated - decompress(transmitted).

        Args:
            key: same key as in :meth:`compensate`.
            compensated: the tensor returned by :meth:`compensate` (the one compressed).
            transmitted: the payload bytes, or the already-decompressed float tensor (to avoid
                decompressing twice).

        Returns:
            The new residual.

        Raises:
            ValueError: bad key, bad payload, or shapes that do not match.
        """
        _check_key(key)
        compensated = _float_tensor(compensated, f"compensated tensor for key {key!r}")
        if isinstance(transmitted, torch.Tensor) and transmitted.dtype != torch.uint8:
            sent = _float_tensor(transmitted, f"transmitted tensor for key {key!r}")
        else:
            sent = decompress(transmitted)
        if sent.shape != compensated.shape:
            raise ValueError(
                f"transmitted tensor for key {key!r} has shape {tuple(sent.shape)} "
                f"but the compensated tensor has shape {tuple(compensated.shape)}"
            )
        residual = compensated - sent.to(compensated.device)
        self._before[key] = self._residuals.get(key)  # not modified in place: kept by reference for discard
        self._residuals[key] = residual
        self._pending[key] = compensated
        return residual

    def rollback(self, key: Union[str, int]) -> None:
        """Undo the last :meth:`update` of ``key`` after a rejected push.

        The residual becomes the whole compensated tensor (previous residual + gradient).

        Raises:
            ValueError: no update of ``key`` is pending (never updated, already rolled back or
                committed).
        """
        _check_key(key)
        if key not in self._pending:
            raise ValueError(f"no pending update to roll back for key {key!r}")
        self._residuals[key] = self._pending.pop(key)
        self._before.pop(key, None)

    def discard(self, key: Union[str, int]) -> None:
        """Undo the last :meth:`compensate`/:meth:`update` of ``key`` entirely: the residual is what it was before.

        For a push that was lost (not rejected) and whose samples will be computed again: keeping
        its gradient in the residual would apply it twice.

        Raises:
            ValueError: no update of ``key`` is pending.
        """
        _check_key(key)
        if key not in self._pending:
            raise ValueError(f"no pending update to discard for key {key!r}")
        self._pending.pop(key)
        before = self._before.pop(key, None)
        if before is None:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = before

    def commit(self, key: Union[str, int]) -> None:
        """Forget the rollback copy of ``key`` once its push was accepted (frees memory)."""
        self._pending.pop(key, None)
        self._before.pop(key, None)

    def residual(self, key: Union[str, int]) -> torch.Tensor | None:
        """Current residual of ``key`` (None if it has none)."""
        return self._residuals.get(key)

    def keys(self) -> list[Union[str, int]]:
        """Keys that hold a residual."""
        return list(self._residuals)

    def reset(self) -> None:
        """Drop every residual and pending rollback."""
        self._residuals.clear()
        self._pending.clear()
        self._before.clear()

    def state_dict(self) -> dict[str, Any]:
        """Residuals (and pending rollbacks) as a plain dict of ints and tensors.

        Loadable with ``torch.load(..., weights_only=True)``.
        """
        return {
            "format_version": _EF_STATE_VERSION,
            "residuals": dict(self._residuals),
            "pending": dict(self._pending),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the residuals with those of a :meth:`state_dict`.

        Raises:
            ValueError: the state is not one produced by :meth:`state_dict`.
        """
        if not isinstance(state, Mapping) or state.get("format_version") != _EF_STATE_VERSION:
            raise ValueError(f"not an ErrorFeedback state_dict (format_version {_EF_STATE_VERSION} expected)")
        loaded: dict[str, dict] = {}
        for section in ("residuals", "pending"):
            entries = state.get(section, {})
            if not isinstance(entries, Mapping):
                raise ValueError(f"ErrorFeedback state_dict[{section!r}] must be a dict")
            for key, tensor in entries.items():
                _check_key(key)
                if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                    raise ValueError(f"ErrorFeedback state_dict[{section!r}][{key!r}] must be a float32 tensor")
            loaded[section] = dict(entries)
        self._residuals = loaded["residuals"]
        self._pending = loaded["pending"]
        self._before = {}
