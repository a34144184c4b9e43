"""Payload values in float32, bfloat16 or float16 (``value_dtype``): exact bytes, exact rounding, and the
float32 format unchanged, so every payload written before 16-bit values existed reads as it did.

References are independent of the module: payloads of the old format are packed here by hand with
``struct``, and 16-bit rounding is torch's own ``tensor.to(dtype)``.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from src.compression import (
    HEADER_SIZE,
    IDENTITY,
    IdentityCompressor,
    build_compressor,
    decompress,
    parse_header,
)
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import CompressionPolicy, policy_from_config
from src.config import ConfigError, SystemConfig, validate_config
from tests.test_compression import _rewrite_header

HALF = [torch.bfloat16, torch.float16]


def _randn(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _old_payload(kind: int, shape: tuple[int, ...], param: int, *arrays: np.ndarray) -> bytes:
    """A payload exactly as the format before 16-bit values wrote it (reserved byte 0, bits 32)."""
    numel = int(np.prod(shape))
    dims = list(shape) + [0] * (8 - len(shape))
    body = struct.pack("<2sBBBBBBQI8I", b"GC", 1, kind, 0, 32, len(shape), 0, numel, param, *dims)
    return body + struct.pack("<I", zlib.crc32(body)) + b"".join(a.tobytes() for a in arrays)


def test_float32_payloads_are_byte_for_byte_the_old_format_and_old_payloads_decode_as_before():
    x = _randn(1000, seed=1).reshape(40, 25)
    identity = _old_payload(0, (40, 25), 0, x.numpy().astype("<f4"))
    assert IDENTITY.compress(x) == identity
    assert torch.equal(decompress(identity), x) and torch.equal(decompress(identity, copy=False), x)

    k = 50
    order = np.sort(np.argsort(-np.abs(x.numpy().ravel()), kind="stable")[:k])
    topk = _old_payload(1, (40, 25), k, x.numpy().ravel()[order].astype("<f4"), order.astype("<i4"))
    assert build_compressor("topk", ratio=0.05).compress(x) == topk
    expected = torch.zeros(1000)
    expected[torch.from_numpy(order)] = x.view(-1)[torch.from_numpy(order)]
    assert torch.equal(decompress(topk), expected.view(40, 25))
    assert parse_header(topk).value_dtype == torch.float32 and parse_header(topk).bits == 32


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("numel, ratio", [(1, 1.0), (1000, 0.05), (300_000, 0.01)])
def test_topk_with_16_bit_values_keeps_the_same_entries_in_6_bytes_each(dtype, numel, ratio):
    x = _randn(numel, seed=numel)
    wide = build_compressor("topk", ratio=ratio)
    narrow = build_compressor("topk", ratio=ratio, value_dtype=str(dtype).removeprefix("torch."))
    assert narrow.value_dtype == dtype
    k = wide.k_for(numel)
    payload = narrow.compress(x)
    assert len(payload) == narrow.wire_size_for(numel) == HEADER_SIZE + 6 * k
    assert len(wide.compress(x)) - HEADER_SIZE == 8 * k  # the body is exactly 0.75x float32's
    header = parse_header(payload)
    assert (header.value_dtype, header.bits, header.param) == (dtype, 16, k)
    wide_dense, narrow_dense = decompress(wide.compress(x)), decompress(payload)
    kept = wide_dense != 0
    assert torch.equal(narrow_dense != 0, kept)  # the same entries ...
    assert torch.equal(narrow_dense[kept], x[kept].to(dtype).float())  # ... rounded as torch rounds
    assert narrow_dense.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF)
def test_identity_with_16_bit_values_is_2_bytes_per_entry_and_torch_rounding(dtype):
    x = _randn(777, seed=3).reshape(7, 111)
    identity = IdentityCompressor(dtype)
    payload = identity.compress(x)
    assert len(payload) == HEADER_SIZE + 2 * 777
    assert torch.equal(decompress(payload), x.to(dtype).float())
    assert torch.equal(decompress(payload, copy=False), x.to(dtype).float())  # no view of 16-bit values: a copy


def test_float16_saturates_and_error_feedback_keeps_the_rest():
    x = torch.tensor([1e5, -2e5, 3.0, 65504.0])
    compressor = build_compressor("topk", ratio=1.0, value_dtype="float16")
    ef = ErrorFeedback()
    compensated = ef.compensate("w", x)
    payload = compressor.compress(compensated)
    sent = decompress(payload)
    assert sent.tolist() == [65504.0, -65504.0, 3.0, 65504.0] and torch.isfinite(sent).all()
    residual = ef.update("w", compensated, payload)
    assert torch.equal(sent + residual, x)  # nothing lost: the residual holds what float16 could not carry


@pytest.mark.parametrize("dtype", HALF)
def test_error_feedback_conserves_mass_through_16_bit_rounding(dtype):
    compressor = build_compressor("topk", ratio=0.1, value_dtype=dtype)
    ef, transmitted, total = (
        ErrorFeedback(),
        torch.zeros(500, dtype=torch.float64),
        torch.zeros(500, dtype=torch.float64),
    )
    for step in range(20):
        gradient = _randn(500, seed=100 + step)
        total += gradient.double()
        compensated = ef.compensate("w", gradient)
        payload = compressor.compress(compensated)
        ef.update("w", compensated, payload)
        transmitted += decompress(payload).double()
    assert torch.allclose(transmitted + ef.residual("w").double(), total, atol=1e-4)


def test_the_policy_sends_uncompressed_values_in_the_compressors_value_dtype():
    policy = CompressionPolicy(build_compressor("topk", ratio=0.1, value_dtype="bfloat16"), warmup_steps=2)
    x = _randn(20, seed=4)
    warm = policy.compress(x, step=0)  # warm-up: identity, in bfloat16
    assert parse_header(warm).name == "identity" and parse_header(warm).value_dtype == torch.bfloat16
    tiny = policy.compress(x[:2], step=5)  # top-k: 56 + 6 bytes, identity in bfloat16: 56 + 4
    assert parse_header(tiny).name == "identity" and len(tiny) == HEADER_SIZE + 2 * 2
    assert parse_header(policy.compress(x[:4], step=5)).name == "topk"  # 56 + 6 against 56 + 8
    assert parse_header(policy.compress(_randn(10_000, seed=5), step=5)).name == "topk"
    quantized = CompressionPolicy(build_compressor("quantization"), warmup_steps=1).compress(x, step=0)
    assert parse_header(quantized).value_dtype == torch.float32  # quantization has no value dtype


def test_inconsistent_value_dtype_headers_are_refused_by_name():
    topk = build_compressor("topk", ratio=0.1).compress(_randn(100, seed=6))
    with pytest.raises(ValueError, match="unknown value dtype code 3"):  # float64 values: no such thing
        decompress(_rewrite_header(topk, value_dtype=3))
    with pytest.raises(ValueError, match="bits=32 for torch.bfloat16 values"):
        decompress(_rewrite_header(topk, value_dtype=2))
    quantized = build_compressor("quantization").compress(_randn(100, seed=6))
    with pytest.raises(ValueError, match="scales are float32"):
        decompress(_rewrite_header(quantized, value_dtype=1))


def test_bad_value_dtypes_are_named():
    with pytest.raises(
        ValueError, match=r"topk.value_dtype must be one of \['float32', 'float16', 'bfloat16'\], got 'float64'"
    ):
        build_compressor("topk", value_dtype="float64")
    with pytest.raises(ValueError, match="identity.value_dtype"):
        build_compressor("identity", value_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['value_dtype'\]"):
        build_compressor("quantization", value_dtype="bfloat16")


def test_the_config_field_reaches_the_policy_and_is_refused_for_quantization():
    system = SystemConfig(compression_enabled=True, compression_type="topk", compression_value_dtype="bfloat16")
    assert policy_from_config(system).compressor.value_dtype == torch.bfloat16
    assert policy_from_config(SystemConfig(compression_enabled=True)).compressor.value_dtype == torch.float32
    with pytest.raises(ConfigError, match=r"system.compression_value_dtype: applies to top-k values"):
        validate_config({"system": {"compression_type": "quantization", "compression_value_dtype": "float16"}})
