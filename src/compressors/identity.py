"""The identity compressor: every value, uncompressed (4 bytes per float32 entry, 2 in 16-bit values).

The uncompressed reference every other compressor is measured against, and what a
:class:`~src.compressors.policy.CompressionPolicy` sends during warm-up and for small tensors.
:meth:`IdentityCompressor.parts` gives a payload as its header and a view of the tensor's own
memory, so a writer of buffer lists sends the values without a copy. No I/O.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import torch

from src.compressors.base import Compressor, check_value_bits
from src.compressors.checks import all_finite, prepare_input, raise_non_finite
from src.compressors.payload_format import (
    HEADER_SIZE,
    Kind,
    decode_values,
    encode_values,
    join_payload,
    pack_header,
    parse_value_dtype,
    value_bits,
)


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

        For a writer of buffer lists (:func:`src.transport.wire.encode` takes the pair as one field): the tensor must
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
        check_value_bits("identity", bits, value_dtype)
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
