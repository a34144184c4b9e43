"""QSGD quantization kernels: one float32 scale per bucket, stochastic rounding to signed codes, and their bit packing.

Each entry becomes a signed code ``q`` in ``[-s, s]``, ``s = 2**(bits-1) - 1`` (127, 7 or 1),
rounded up or down at random so that ``E[q * scale / s] = x``. The numpy kernel (``host_quantize``)
serves CPU tensors on cache-sized chunks of buckets, its torch twin (``device_quantize``) tensors on
accelerators. Packing: 8 bits are int8 codes, 1 byte per entry; 4 bits are ``q + 7`` in two
nibbles per byte (low nibble first); 2 bits are ``q + 1`` in four 2-bit fields per byte (lowest
bits first). No I/O; torch, numpy and the standard library only.
"""

from __future__ import annotations

import types

import numpy as np
import torch

QUANT_BITS = (2, 4, 8)
# Rows per step ~ 256K entries: the temporaries stay cache-resident and are reused, ~3x faster
# than whole-tensor temporaries (page faults dominate those).
_QUANT_CHUNK_ENTRIES = 1 << 18


def quantization_levels(bits: int) -> int:
    """Magnitude levels ``s = 2**(bits-1) - 1`` of ``bits``-bit codes: 127, 7 or 1."""
    return 2 ** (bits - 1) - 1


def host_quantize(
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


def device_quantize(
    flat: torch.Tensor, size: int, levels: int, generator: torch.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """torch twin of :func:`host_quantize` for tensors on accelerators (one shot, padded)."""
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


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """int8 codes in [-s, s] -> the uint8 wire bytes for ``bits``."""
    if bits == 8:
        return codes.view(np.uint8)
    per_byte = 8 // bits
    shifted = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    np.add(codes, quantization_levels(bits), out=shifted[: codes.size], casting="unsafe")  # 0..2s
    fields = shifted.reshape(-1, per_byte)
    packed = fields[:, 0].copy()
    for j in range(1, per_byte):
        packed |= fields[:, j] << (bits * j)
    return packed


def _unpack_table(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """For every byte value: its ``8 // bits`` float32 codes, and whether all are in range."""
    per_byte, mask, levels = 8 // bits, (1 << bits) - 1, quantization_levels(bits)
    byte = np.arange(256)
    fields = np.stack([(byte >> (bits * j)) & mask for j in range(per_byte)], axis=1)
    return (fields - levels).astype(np.float32), (fields <= 2 * levels).all(axis=1)


# One table lookup per byte decodes all its fields at once: ~3x faster than shift-and-mask.
_UNPACK_TABLES = types.MappingProxyType({bits: _unpack_table(bits) for bits in (2, 4)})


def unpack_codes(buf: memoryview, offset: int, numel: int, bits: int) -> np.ndarray:
    """Wire bytes -> writable float32 codes in [-s, s]; rejects codes outside that range."""
    if bits == 8:
        raw = np.frombuffer(buf, dtype=np.int8, count=numel, offset=offset)
        if raw.min() < -quantization_levels(8):
            raise ValueError("quantization payload holds an out-of-range 8-bit code (-128)")
        return raw.astype(np.float32)
    per_byte = 8 // bits
    raw = np.frombuffer(buf, dtype=np.uint8, count=-(-numel // per_byte), offset=offset)
    table, valid = _UNPACK_TABLES[bits]
    if not np.take(valid, raw).all():
        raise ValueError(f"quantization payload holds an out-of-range {bits}-bit code")
    return np.take(table, raw, axis=0).reshape(-1)[:numel]
