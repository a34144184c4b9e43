"""The quantization compressor: QSGD-style stochastic rounding to 2, 4 or 8-bit codes, one scale per bucket.

``bits / 8`` bytes per entry plus one float32 scale per ``bucket_size`` entries; unbiased in
expectation. The kernels (scales, rounding, bit packing) are :mod:`src.compressors.quantization_codes`'.
No I/O.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import numpy as np
import torch

from src.compressors.base import Compressor
from src.compressors.checks import check_numel, raise_non_finite
from src.compressors.payload_format import (
    BYTES_PER_SCALE,
    F32,
    HEADER_SIZE,
    UINT32_MAX,
    Kind,
    join_payload,
    pack_header,
    read_array,
)
from src.compressors.quantization_codes import (
    QUANT_BITS,
    device_quantize,
    host_quantize,
    pack_codes,
    quantization_levels,
    unpack_codes,
)


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
        if self._on_host(flat):
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
