"""Gradient compression: stateless compressors whose output is the exact bytes sent on the wire.

What it is for
--------------
One algorithm module shared by the gRPC parameter server (payloads go straight into a protobuf
``bytes`` field), the DDP communication hooks (``torch.frombuffer(payload, dtype=torch.uint8)``
goes into ``all_gather``) and a user's own training loop. It does no I/O and imports nothing but
torch, numpy, the standard library and the modules of its family (below).

    c = build_compressor("topk", ratio=0.01)           # or "quantization", "identity"
    ef = ErrorFeedback()                               # from src.error_feedback
    compensated = ef.compensate("fc.weight", grad)     # grad + residual
    payload = c.compress(compensated)                  # bytes; len(payload) is the wire size
    ef.update("fc.weight", compensated, payload)       # residual = compensated - what was sent
    ...                                                # push rejected: ef.rollback("fc.weight")
    dense = decompress(payload)                        # receiver: the header says everything

This module holds the compressors (the :class:`Compressor` interface, identity, top-k,
quantization), their registry (:func:`build_compressor`) and the readers of any payload
(:func:`parse_header`, :func:`decompress`, :func:`wire_size`). Its family, one concept each:

* ``src/payload_format.py``      the 56-byte header, its codes, and values in 32 or 16 bits.
* ``src/compression_checks.py``  what ``compress`` accepts; finite values in one pass.
* ``src/topk_selection.py``      which entries top-k keeps (exact or sampled threshold).
* ``src/quantization_codes.py``  QSGD scales, stochastic rounding and the 2/4/8-bit packing.
* ``src/error_feedback.py``      :class:`~src.error_feedback.ErrorFeedback`: residuals, rollback.
* ``src/compression_policy.py``  :class:`~src.compression_policy.CompressionPolicy` (warm-up,
  skipping small tensors) and ``policy_from_config``.

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
import math
import numbers
import sys
import types
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from src.compression_checks import all_finite, check_numel, prepare_input, raise_non_finite, resolve_generator
from src.payload_format import (
    BYTES_PER_IDENTITY_ENTRY,
    BYTES_PER_INDEX,
    BYTES_PER_SCALE,
    BYTES_PER_TOPK_ENTRY,
    F32,
    FORMAT_VERSION,
    HEADER_SIZE,
    I32,
    INT32_MAX,
    MAGIC,
    MAX_NDIM,
    UINT32_MAX,
    VALUE_DTYPES,
    Kind,
    PayloadHeader,
    PayloadLike,
    as_buffer,
    decode_values,
    encode_values,
    join_payload,
    pack_header,
    parse_value_dtype,
    read_array,
    read_header,
    value_bits,
)
from src.quantization_codes import (
    QUANT_BITS,
    device_quantize,
    host_quantize,
    pack_codes,
    quantization_levels,
    unpack_codes,
)
from src.topk_selection import (
    SELECTIONS,
    device_exact_topk,
    device_sampled_topk,
    host_exact_topk,
    host_sampled_topk,
)

# The format's constants and PayloadHeader are re-exported: they are this module's documented API
# (``HEADER_SIZE`` above, ``docs/compression.md``), imported from here by the PS, the hooks and tests.
__all__ = [
    "BYTES_PER_IDENTITY_ENTRY",
    "BYTES_PER_INDEX",
    "BYTES_PER_SCALE",
    "BYTES_PER_TOPK_ENTRY",
    "COMPRESSORS",
    "Compressor",
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
    "wire_size",
]


# --------------------------------------------------------------------------------------------
# Reading any payload
# --------------------------------------------------------------------------------------------


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
    return read_header(as_buffer(payload), _checked_body_size)


def decompress(
    payload: PayloadLike,
    *,
    device: torch.device | str | None = None,
    copy: bool = True,
    header: PayloadHeader | None = None,
    finite_values: int = 0,
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
        finite_values: how many of the leading values the caller has checked finite already (a receiver
            that checks a payload's values as they arrive); only the rest are checked. Used by the
            ``copy=False`` view of a float32 identity payload, the one decode that checks values in place.

    Returns:
        A float32 tensor of the compressed tensor's shape; new and writable unless ``copy=False``.

    Raises:
        ValueError: the payload is malformed (see :func:`parse_header`) or its buffers are
            (out-of-range indices or codes, non-finite values).
    """
    buf = as_buffer(payload)
    if header is None:
        header = read_header(buf, _checked_body_size)
    if not copy and header.kind == Kind.IDENTITY and header.value_dtype == torch.float32 and sys.byteorder == "little":
        flat = _identity_view(header, buf, finite_values)
    else:
        flat = _BY_KIND[header.kind]._decode(header, buf)
    out = flat.reshape(header.shape)
    return out if device is None else out.to(device)


def topk_entries(payload: PayloadLike) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept entries of a top-k payload: (positions, int32 and strictly increasing; float32 values), checked
    as :func:`decompress` checks them; ``None`` for a payload of another kind (decompress that one).

    What a receiver that only adds the payload into a dense tensor needs: its ``k`` entries, not a dense
    tensor of zeros around them (:mod:`src.compressed_exchange`).

    Raises:
        ValueError: the payload is malformed, as :func:`decompress` says.
    """
    buf = as_buffer(payload)
    header = read_header(buf, _checked_body_size)
    if header.kind != Kind.TOPK:
        return None
    return TopKCompressor._entries(header, buf)


def wire_size(payload: PayloadLike) -> int:
    """Bytes that cross the wire for ``payload``: simply its length (header included)."""
    return len(as_buffer(payload))


# torch.from_numpy warns (once per process) when handed a read-only array; the read-only view of
# decompress(copy=False) is one on purpose.
for _message in ("The given NumPy array is not writable", "The given buffer is not writable"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=__name__.replace(".", r"\."))


def _identity_view(header: PayloadHeader, buf: memoryview, finite_values: int = 0) -> torch.Tensor:
    """The float32 values of an identity payload as a read-only tensor over ``buf`` (no copy); the first
    ``finite_values`` were checked finite by the caller, the rest are checked here."""
    values = torch.frombuffer(buf, dtype=torch.float32, count=header.numel, offset=HEADER_SIZE)
    if finite_values < header.numel and not all_finite(values[max(finite_values, 0) :]):
        raise ValueError("identity payload holds NaN/Inf values")
    return values


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
        flat, shape, source_dtype = prepare_input(tensor)
        gen = resolve_generator(generator, seed, flat.device)
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
        numel = check_numel(numel)
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
    if bits != value_bits(value_dtype):
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
        object.__setattr__(self, "value_dtype", parse_value_dtype(self.value_dtype, "identity.value_dtype"))

    def parts(self, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
        """:meth:`compress`'s payload in two parts, not joined: its header and its values, which for float32
        values of a contiguous CPU float32 tensor are a view of the tensor's own memory (no copy).

        For a writer of buffer lists (:func:`src.wire.encode` takes the pair as one field): the tensor must
        not change until the payload is sent. Raises what :meth:`compress` raises.
        """
        flat, shape, source_dtype = prepare_input(tensor)
        header, values = self._parts(flat, shape, source_dtype)
        return header, memoryview(np.ascontiguousarray(values)).cast("B")

    def _parts(self, flat, shape, source_dtype) -> tuple[bytes, np.ndarray]:
        values = flat.cpu().numpy()
        if not all_finite(values):
            raise_non_finite(flat, shape, source_dtype)
        header = pack_header(self.kind, source_dtype, self._bits(), shape, flat.numel(), 0, self.value_dtype)
        return header, encode_values(values, self.value_dtype)

    def _encode(self, flat, shape, source_dtype, generator):
        return join_payload(*self._parts(flat, shape, source_dtype))

    def _bits(self) -> int:
        return value_bits(self.value_dtype)

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
        values = decode_values(buf, header.value_dtype, header.numel, HEADER_SIZE)
        if not all_finite(values):
            raise ValueError("identity payload holds NaN/Inf values")
        return torch.from_numpy(values)


#: The shared identity compressor (stateless, so one instance serves everybody).
IDENTITY = IdentityCompressor()


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
        if self.selection not in SELECTIONS:
            raise ValueError(f"topk.selection must be one of {list(SELECTIONS)}, got {self.selection!r}")
        if (
            not isinstance(self.sample_size, numbers.Integral)
            or isinstance(self.sample_size, bool)
            or self.sample_size < 1024
        ):
            raise ValueError(f"topk.sample_size must be an int >= 1024, got {self.sample_size!r}")
        object.__setattr__(self, "ratio", float(ratio))
        object.__setattr__(self, "value_dtype", parse_value_dtype(self.value_dtype, "topk.value_dtype"))

    def k_for(self, numel: int) -> int:
        """Entries kept for a tensor of ``numel`` entries."""
        numel = check_numel(numel)
        return min(numel, max(1, math.ceil(round(self.ratio * numel, 6))))

    def _encode(self, flat, shape, source_dtype, generator):
        numel = flat.numel()
        if numel > INT32_MAX:
            raise ValueError(f"top-k indices are int32: cannot compress {numel} entries (more than {INT32_MAX})")
        k = self.k_for(numel)
        if _use_host_path(flat):
            values = flat.numpy()
            indices = None
            if self.selection == "sampled":
                indices = host_sampled_topk(values, k, self.sample_size)
            if indices is None:
                indices = host_exact_topk(values, k)
            if indices is None:
                raise_non_finite(flat, shape, source_dtype)
            kept = values[indices]
        else:
            if not all_finite(flat):
                raise_non_finite(flat, shape, source_dtype)
            if self.selection == "sampled":
                selected = device_sampled_topk(flat, k, self.sample_size)
            else:
                selected = device_exact_topk(flat, k)
            kept = flat.index_select(0, selected).cpu().numpy()
            indices = selected.cpu().numpy()
        header = pack_header(self.kind, source_dtype, self._bits(), shape, numel, k, self.value_dtype)
        return join_payload(header, encode_values(kept, self.value_dtype), indices.astype(I32))

    def _bits(self) -> int:
        return value_bits(self.value_dtype)

    def _param(self, numel: int) -> int:
        return self.k_for(numel)

    @classmethod
    def _check_header(cls, *, bits, numel, param, value_dtype):
        _check_value_bits("topk", bits, value_dtype)
        if not 1 <= param <= numel or numel > INT32_MAX:
            raise ValueError(f"malformed topk payload header: bits={bits}, k={param}, numel={numel}")

    @classmethod
    def _body_size(cls, *, bits, numel, param):
        return (bits // 8 + BYTES_PER_INDEX) * param

    @classmethod
    def _entries(cls, header, buf) -> tuple[np.ndarray, np.ndarray]:
        """The payload's positions (int32, strictly increasing, in range) and float32 values, checked."""
        k, numel = header.param, header.numel
        values = decode_values(buf, header.value_dtype, k, HEADER_SIZE)
        indices = read_array(buf, I32, k, HEADER_SIZE + header.bits // 8 * k)
        if not all_finite(values):
            raise ValueError("topk payload holds NaN/Inf values")
        if indices[0] < 0 or indices[-1] >= numel or (k > 1 and not (np.diff(indices) > 0).all()):
            raise ValueError(
                f"topk payload indices are not strictly increasing within [0, {numel}): the buffers are garbled"
            )
        return indices, values

    @classmethod
    def _decode(cls, header, buf):
        indices, values = cls._entries(header, buf)
        out = np.zeros(header.numel, dtype=np.float32)  # calloc'd: pages are zeroed on first touch
        out[indices] = values
        return torch.from_numpy(out)


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
        if isinstance(self.bits, bool) or self.bits not in QUANT_BITS:
            raise ValueError(f"quantization.bits must be one of {list(QUANT_BITS)}, got {self.bits!r}")
        size = self.bucket_size
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or not 0 < size <= UINT32_MAX:
            raise ValueError(f"quantization.bucket_size must be a positive int (< 2**32), got {size!r}")
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "bucket_size", int(size))

    @property
    def levels(self) -> int:
        """Magnitude levels ``s``: 127, 7 or 1."""
        return quantization_levels(self.bits)

    def num_buckets(self, numel: int) -> int:
        """Buckets (and so float32 scales) for a tensor of ``numel`` entries."""
        return -(-check_numel(numel) // self.bucket_size)

    def _encode(self, flat, shape, source_dtype, generator):
        numel, size = flat.numel(), self.bucket_size
        if _use_host_path(flat):
            scales, codes = host_quantize(flat.numpy(), size, self.levels, generator)
        else:
            scales, codes = device_quantize(flat, size, self.levels, generator)
        if not np.isfinite(scales).all():  # a bucket's max |x| is NaN/Inf iff it holds one
            raise_non_finite(flat, shape, source_dtype)
        header = pack_header(self.kind, source_dtype, self.bits, shape, numel, size)
        return join_payload(header, scales.astype(F32, copy=False), pack_codes(codes, self.bits))

    def _bits(self) -> int:
        return self.bits

    def _param(self, numel: int) -> int:
        return self.bucket_size

    @classmethod
    def _check_header(cls, *, bits, numel, param, value_dtype):
        if bits not in QUANT_BITS or param == 0 or value_dtype != torch.float32:
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
        scales = read_array(buf, F32, num_buckets, HEADER_SIZE)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("quantization payload holds negative or non-finite scales")
        out = unpack_codes(buf, HEADER_SIZE + BYTES_PER_SCALE * num_buckets, numel, bits)
        step = scales / np.float32(quantization_levels(bits))
        full = numel // size
        if full:
            out[: full * size].reshape(full, size)[...] *= step[:full, None]
        if full * size < numel:
            out[full * size :] *= step[full]
        return torch.from_numpy(out)


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


def _checked_body_size(kind: Kind, *, bits: int, numel: int, param: int, value_dtype: torch.dtype) -> int:
    """Body bytes of a ``kind`` payload; ValueError when the header's fields are impossible for that kind."""
    cls = _BY_KIND[kind]
    cls._check_header(bits=bits, numel=numel, param=param, value_dtype=value_dtype)
    return cls._body_size(bits=bits, numel=numel, param=param)


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
