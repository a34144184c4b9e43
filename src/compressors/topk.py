"""The top-k compressor: the ``ceil(ratio * numel)`` entries of largest magnitude, with their positions.

8 bytes per kept entry (float32 value + int32 index), 6 with 16-bit values. Which entries are kept
is :mod:`src.compressors.topk_selection`'s (exact, or a sampled threshold that finds the same
entries faster). Pair it with :class:`~src.compressors.error_feedback.ErrorFeedback`. No I/O.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import numpy as np
import torch

from src.compressors.base import Compressor, check_value_bits
from src.compressors.checks import all_finite, check_numel, raise_non_finite
from src.compressors.payload_format import (
    BYTES_PER_INDEX,
    HEADER_SIZE,
    I32,
    INT32_MAX,
    Kind,
    decode_values,
    encode_values,
    join_payload,
    pack_header,
    parse_value_dtype,
    read_array,
    value_bits,
)
from src.compressors.topk_selection import (
    SELECTIONS,
    device_exact_topk,
    device_sampled_topk,
    host_exact_topk,
    host_sampled_topk,
)


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
        if self._on_host(flat):
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
        check_value_bits("topk", bits, value_dtype)
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
