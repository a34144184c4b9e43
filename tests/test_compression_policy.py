"""Which compressor a send uses (src/compressors/policy.py): identity during warm-up, skipped where compression
would not shrink, built from the config's system section."""

from __future__ import annotations

import pytest
import torch

from src.compression import (
    HEADER_SIZE,
    IDENTITY,
    Kind,
    build_compressor,
    decompress,
    parse_header,
)
from src.compressors.policy import CompressionPolicy

pytestmark = pytest.mark.timeout(120)


def _randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_policy_warmup_sends_identity_then_compresses():
    topk = build_compressor("topk", ratio=0.01)
    policy = CompressionPolicy(topk, warmup_steps=3)
    x = _randn(10_000, seed=1)
    kinds = [parse_header(policy.compress(x, step)).kind for step in range(5)]
    assert kinds == [Kind.IDENTITY] * 3 + [Kind.TOPK] * 2
    assert policy.compressor_for(2, 10_000) is IDENTITY
    assert policy.compressor_for(3, 10_000) is topk
    # The receiver needs no policy: the header names the kind.
    assert torch.equal(decompress(policy.compress(x, 0)), x)
    assert torch.equal(policy.decompress(policy.compress(x, 5)), topk.decompress(topk.compress(x)))


def test_policy_skips_tensors_compression_would_not_shrink():
    topk = build_compressor("topk", ratio=0.01)
    policy = CompressionPolicy(topk)  # min_compression_rate 1.0: skip only if not smaller
    bias = _randn(10, seed=2)  # topk 56 + 8 = 64 bytes against identity 56 + 40 = 96
    assert topk.compression_rate(10) == (HEADER_SIZE + 40) / (HEADER_SIZE + 8)
    assert policy.compressor_for(0, 10) is topk
    assert policy.compressor_for(0, 1) is IDENTITY  # 64 bytes vs 60: would grow
    assert parse_header(policy.compress(torch.ones(1), 0)).kind == Kind.IDENTITY
    strict = CompressionPolicy(build_compressor("quantization"), min_compression_rate=4.0)
    assert strict.compressor_for(0, 100) is IDENTITY  # 8-bit is < 4x
    assert strict.compressor_for(0, 10**6).name == "identity"
    loose = CompressionPolicy(build_compressor("quantization"), min_compression_rate=3.0)
    assert loose.compressor_for(0, 10**6).name == "quantization"
    assert torch.equal(decompress(strict.compress(bias, 10)), bias)


def test_policy_validation():
    with pytest.raises(ValueError, match="policy.warmup_steps"):
        CompressionPolicy(IDENTITY, warmup_steps=-1)
    with pytest.raises(ValueError, match="policy.min_compression_rate"):
        CompressionPolicy(IDENTITY, min_compression_rate=float("nan"))
    with pytest.raises(ValueError, match="policy.compressor"):
        CompressionPolicy("topk")
    with pytest.raises(ValueError, match="empty tensor"):
        CompressionPolicy(IDENTITY).compress(torch.zeros(0), 0)


def test_policy_from_config_builds_what_the_system_section_asks_for():
    from src.compressors.policy import policy_from_config
    from src.config import SystemConfig

    assert policy_from_config(SystemConfig(compression_enabled=False)) is None
    topk = policy_from_config(
        SystemConfig(
            compression_enabled=True,
            compression_type="topk",
            compression_ratio=0.1,
            topk_selection="exact",
            warmup_steps=3,
        )
    )
    assert (topk.compressor.name, topk.compressor.ratio, topk.compressor.selection, topk.warmup_steps) == (
        "topk",
        0.1,
        "exact",
        3,
    )
    quant = policy_from_config(
        SystemConfig(
            compression_enabled=True, compression_type="quantization", quantization_bits=4, quantization_bucket_size=128
        )
    )
    assert (quant.compressor.name, quant.compressor.bits, quant.compressor.bucket_size) == ("quantization", 4, 128)
