"""Contract tests of src/compression.py: selection, unbiasedness, wire bytes, bad input (error feedback and the
warm-up policy: tests/test_error_feedback.py, tests/test_compression_policy.py).

Tolerances are stated next to each assertion. Randomness is seeded everywhere, so a statistical
bound set at 6 standard deviations cannot flake between runs.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import math
import struct
import sys
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from src import compression as comp
from src.compression import (
    BYTES_PER_IDENTITY_ENTRY,
    BYTES_PER_SCALE,
    BYTES_PER_TOPK_ENTRY,
    COMPRESSORS,
    HEADER_SIZE,
    IDENTITY,
    Kind,
    build_compressor,
    decompress,
    parse_header,
    wire_size,
)
from src.compressors import base as compressor_base
from src.compressors import payload_format, topk_selection
from src.compressors import topk as topk_module

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(deadline=None, max_examples=25, derandomize=True)

ALL_COMPRESSORS = [
    build_compressor("identity"),
    build_compressor("topk", ratio=0.1, selection="exact"),
    build_compressor("topk", ratio=0.1, selection="sampled"),
    build_compressor("quantization", bits=8),
    build_compressor("quantization", bits=4, bucket_size=64),
    build_compressor("quantization", bits=2, bucket_size=7),
]


ROOT = Path(__file__).resolve().parent.parent
PATHS = ["host", "torch"]


@contextlib.contextmanager
def kernels(path: str):
    """Run CPU tensors through the numpy kernels ("host") or the accelerator ("torch") ones."""
    if path == "host":
        yield
    else:
        with mock.patch.object(compressor_base, "_use_host_path", lambda flat: False):
            yield


def _randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference_topk(x: torch.Tensor, k: int) -> np.ndarray:
    """Ascending indices of the k largest |x|, ties broken towards the lower index."""
    mags = x.reshape(-1).abs().double().numpy()
    order = np.lexsort((np.arange(mags.size), -mags))  # primary: -|x|, secondary: index
    return np.sort(order[:k])


def _topk_indices(payload: bytes) -> np.ndarray:
    header = parse_header(payload)
    k = header.param
    return np.frombuffer(payload, dtype="<i4", count=k, offset=HEADER_SIZE + 4 * k)


def _rewrite_header(payload: bytes, **fields) -> bytes:
    """Change header fields and recompute the checksum, so only the named problem remains."""
    names = ["magic", "version", "kind", "dtype", "bits", "ndim", "value_dtype", "numel", "param"]
    body = payload_format._HEADER_BODY
    values = list(body.unpack_from(payload))
    for name, value in fields.items():
        values[names.index(name)] = value
    head = body.pack(*values)
    return head + struct.pack("<I", zlib.crc32(head)) + payload[HEADER_SIZE:]


# ------------------------------------------------------------------------------------------
# Module shape: purity, registry, builder
# ------------------------------------------------------------------------------------------


# src/compression.py (the face) and the modules of src/compressors/, one concept each (they import each other).
COMPRESSION_FAMILY = (
    "src/compression.py",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "src" / "compressors").glob("*.py")),
)


@pytest.mark.parametrize("module", COMPRESSION_FAMILY)
def test_module_imports_only_torch_numpy_and_stdlib(module):
    source = (ROOT / module).read_text()
    tree = ast.parse(source)
    assert ast.get_docstring(tree), "module must start with a docstring"
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "__future__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            if node.module.startswith("src.compressors."):
                continue
            roots = {node.module.split(".")[0]}
        else:
            continue
        assert roots <= allowed, f"forbidden import {roots - allowed}"


def test_registry_is_complete_and_named():
    assert set(COMPRESSORS) == {"identity", "topk", "quantization"}
    for name, cls in COMPRESSORS.items():
        assert cls.name == name
        assert cls.kind == Kind[name.upper()]
        assert build_compressor(name).name == name
    assert HEADER_SIZE == 56


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("zip", {}, "unknown compressor 'zip'"),
        ("topk", {"ratio": 0.1, "bits": 8}, r"unknown option\(s\) \['bits'\]"),
        ("identity", {"ratio": 0.1}, r"unknown option\(s\) \['ratio'\]"),
        ("quantization", {"bucket": 3}, r"unknown option\(s\) \['bucket'\]"),
        ("topk", {"ratio": 0.0}, r"topk.ratio must be a number in \(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"topk.ratio"),
        ("topk", {"ratio": -0.1}, r"topk.ratio"),
        ("topk", {"ratio": float("nan")}, r"topk.ratio"),
        ("topk", {"ratio": True}, r"topk.ratio"),
        ("topk", {"ratio": "0.1"}, r"topk.ratio"),
        ("topk", {"selection": "approx"}, r"topk.selection must be one of"),
        ("topk", {"sample_size": 10}, r"topk.sample_size"),
        ("quantization", {"bits": 3}, r"quantization.bits must be one of \[2, 4, 8\]"),
        ("quantization", {"bits": 16}, r"quantization.bits"),
        ("quantization", {"bits": True}, r"quantization.bits"),
        ("quantization", {"bucket_size": 0}, r"quantization.bucket_size must be a positive int"),
        ("quantization", {"bucket_size": -4}, r"quantization.bucket_size"),
        ("quantization", {"bucket_size": 2.5}, r"quantization.bucket_size"),
    ],
)
def test_build_rejects_bad_config(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_compressor(name, **kwargs)


def test_compressors_are_stateless_and_leave_input_untouched():
    x = _randn((64, 33), seed=1)
    before = x.clone()
    for c in ALL_COMPRESSORS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.ratio = 0.5  # frozen dataclass: no state to mutate
        assert c.compress(x, seed=3) == c.compress(x, seed=3)
        assert torch.equal(x, before)


# ------------------------------------------------------------------------------------------
# Wire bytes: len(payload) is exactly the invariant's cost
# ------------------------------------------------------------------------------------------


@SETTINGS
@given(numel=st.integers(1, 5000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**16))
def test_topk_wire_bytes_are_8_per_entry_plus_header(numel, ratio, seed):
    c = build_compressor("topk", ratio=ratio)
    payload = c.compress(_randn(numel, seed))
    k = c.k_for(numel)
    assert k == min(numel, max(1, math.ceil(round(ratio * numel, 6))))
    assert len(payload) == wire_size(payload) == HEADER_SIZE + BYTES_PER_TOPK_ENTRY * k
    assert len(payload) == c.wire_size_for(numel)
    assert parse_header(payload).param == k


def test_topk_k_is_ceil_of_ratio_times_numel():
    c = build_compressor("topk", ratio=0.07)
    assert c.k_for(100) == 7  # 0.07 * 100 == 7.000000000000001 in binary: still 7
    assert build_compressor("topk", ratio=0.01).k_for(11_000_000) == 110_000
    assert build_compressor("topk", ratio=0.01).k_for(150) == 2
    assert build_compressor("topk", ratio=1e-9).k_for(10) == 1
    assert build_compressor("topk", ratio=1.0).k_for(10) == 10


@SETTINGS
@given(
    numel=st.integers(1, 3000),
    bits=st.sampled_from([2, 4, 8]),
    bucket_size=st.integers(1, 700),
    seed=st.integers(0, 2**16),
)
def test_quantization_wire_bytes(numel, bits, bucket_size, seed):
    c = build_compressor("quantization", bits=bits, bucket_size=bucket_size)
    payload = c.compress(_randn(numel, seed), seed=seed)
    num_buckets = math.ceil(numel / bucket_size)
    code_bytes = math.ceil(numel * bits / 8)  # 8 bits: n; 4 bits: 2/byte; 2 bits: 4/byte
    assert len(payload) == HEADER_SIZE + BYTES_PER_SCALE * num_buckets + code_bytes
    assert len(payload) == c.wire_size_for(numel)


def test_eight_bit_quantization_is_one_byte_per_entry_plus_scales():
    n = 10_000
    payload = build_compressor("quantization").compress(_randn(n), seed=0)
    assert len(payload) == HEADER_SIZE + n + BYTES_PER_SCALE * math.ceil(n / 512)


@SETTINGS
@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=4), seed=st.integers(0, 2**16))
def test_identity_is_exact_and_4_bytes_per_entry(shape, seed):
    x = _randn(shape, seed)
    payload = IDENTITY.compress(x)
    assert len(payload) == HEADER_SIZE + BYTES_PER_IDENTITY_ENTRY * x.numel()
    out = decompress(payload)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, x)


def test_payload_is_bytes_and_travels_as_uint8_tensor():
    x = _randn((17, 5), seed=2)
    for c in ALL_COMPRESSORS:
        payload = c.compress(x, seed=1)
        assert type(payload) is bytes
        as_tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # all_gather form
        expected = decompress(payload)
        for form in (as_tensor, bytearray(payload), memoryview(payload), as_tensor.numpy()):
            assert torch.equal(decompress(form), expected)
        assert wire_size(as_tensor) == len(payload)
        header = parse_header(payload)
        assert header.name == c.name and header.shape == (17, 5) and header.numel == 85
        assert header.payload_size == len(payload)


# ------------------------------------------------------------------------------------------
# Top-k selection
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@SETTINGS
@given(
    numel=st.integers(1, 4000),
    ratio=st.floats(0.001, 1.0),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_exact_topk_keeps_k_largest_with_lower_index_winning_ties(path, numel, ratio, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct magnitudes: most of the k-th largest value's copies must be cut
        x = torch.randint(-3, 4, (numel,), generator=gen).float()
    else:
        x = torch.randn(numel, generator=gen)
    c = build_compressor("topk", ratio=ratio, selection="exact")
    with kernels(path):
        payload = c.compress(x)
    k = c.k_for(numel)
    np.testing.assert_array_equal(_topk_indices(payload), _reference_topk(x, k))
    out = decompress(payload)
    kept = torch.from_numpy(_reference_topk(x, k).astype(np.int64))
    assert torch.equal(out[kept], x[kept])  # values are sent exactly
    mask = torch.ones(numel, dtype=torch.bool)
    mask[kept] = False
    assert not out[mask].any()


@pytest.mark.parametrize("path", PATHS)
def test_topk_tie_rule_is_lower_index_first(path):
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    with kernels(path):
        payload = build_compressor("topk", ratio=0.5, selection="exact").compress(x)  # k = 3
    assert _topk_indices(payload).tolist() == [1, 2, 4]
    assert decompress(payload).tolist() == [0.0, -2.0, 2.0, 0.0, -2.0, 0.0]


@pytest.mark.parametrize("path", PATHS)
@settings(deadline=None, max_examples=12, derandomize=True)
@given(
    numel=st.integers(20_000, 150_000),
    ratio=st.sampled_from([0.02, 0.05, 0.1, 0.3]),
    seed=st.integers(0, 2**16),
    distribution=st.sampled_from(["normal", "heavy_tail", "ties", "sparse"]),
)
def test_sampled_topk_is_identical_to_exact(path, numel, ratio, seed, distribution):
    """The sampled selection's guarantee: tolerance 0, exactly the exact mode's k entries.

    sample_size=1024 makes these sizes take the sampling path (it is skipped for tensors under
    4x the sample).
    """
    gen = torch.Generator().manual_seed(seed)
    if distribution == "normal":
        x = torch.randn(numel, generator=gen)
    elif distribution == "heavy_tail":
        x = torch.randn(numel, generator=gen) ** 3 * 1e3
    elif distribution == "ties":
        x = torch.randint(-4, 5, (numel,), generator=gen).float()
    else:
        x = torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) < 0.01)
    sampled = build_compressor("topk", ratio=ratio, selection="sampled", sample_size=1024)
    exact = build_compressor("topk", ratio=ratio, selection="exact")
    with kernels(path):
        payload = sampled.compress(x)
    assert payload == exact.compress(x)  # host exact path: torch.topk + tie rule
    indices = _topk_indices(payload)
    k = sampled.k_for(numel)
    assert indices.size == k
    kth_largest = x.abs().sort(descending=True).values[k - 1]
    assert bool((x.abs()[torch.from_numpy(indices.astype(np.int64))] >= kth_largest).all())


def _spy_selection(monkeypatch):
    """Count threshold scans and torch.topk fallbacks of the sampled selection."""
    calls = {"scans": 0, "exact": 0}
    scan, exact = topk_selection._host_scan, topk_module.host_exact_topk

    def counting_scan(*args):
        calls["scans"] += 1
        return scan(*args)

    def counting_exact(*args):
        calls["exact"] += 1
        return exact(*args)

    monkeypatch.setattr(topk_selection, "_host_scan", counting_scan)
    monkeypatch.setattr(topk_module, "host_exact_topk", counting_exact)
    return calls


def test_sampled_topk_large_tensor_matches_reference(monkeypatch):
    calls = _spy_selection(monkeypatch)
    x = _randn(1_000_000, seed=7)
    sampled = build_compressor("topk", ratio=0.01)  # default: sampled, sample_size 65536
    k = sampled.k_for(x.numel())
    payload = sampled.compress(x)
    np.testing.assert_array_equal(_topk_indices(payload), _reference_topk(x, k))
    assert calls == {"scans": 1, "exact": 0}  # first threshold estimate was enough


@pytest.mark.parametrize(
    "sigmas, attempts, min_scans, max_scans, exact_calls",
    [
        (-40.0, 3, 2, 3, 0),  # first threshold too high, then lowered until enough candidates
        (-40.0, 1, 1, 1, 1),  # too high and no retry left: torch.topk
        (4.0, 0, 0, 0, 1),
    ],
)
def test_sampled_topk_retry_and_fallback_paths_stay_exact(
    monkeypatch, sigmas, attempts, min_scans, max_scans, exact_calls
):
    # A negative margin puts the first threshold above the k-th largest: too few candidates,
    # so the threshold is lowered (attempts > 1) or selection falls back to torch.topk.
    monkeypatch.setattr(topk_selection, "_SAMPLE_SIGMAS", sigmas)
    monkeypatch.setattr(topk_selection, "_SAMPLE_ATTEMPTS", attempts)
    calls = _spy_selection(monkeypatch)
    x = _randn(60_000, seed=11)
    sampled = build_compressor("topk", ratio=0.05, sample_size=1024)
    payload = sampled.compress(x)
    np.testing.assert_array_equal(_topk_indices(payload), _reference_topk(x, sampled.k_for(60_000)))
    assert min_scans <= calls["scans"] <= max_scans and calls["exact"] == exact_calls


@pytest.mark.parametrize("sigmas, attempts", [(-40.0, 3), (-40.0, 1), (4.0, 0)])
def test_torch_path_sampled_retry_and_fallback_stay_exact(monkeypatch, sigmas, attempts):
    monkeypatch.setattr(topk_selection, "_SAMPLE_SIGMAS", sigmas)
    monkeypatch.setattr(topk_selection, "_SAMPLE_ATTEMPTS", attempts)
    x = _randn(60_000, seed=13)
    sampled = build_compressor("topk", ratio=0.05, sample_size=1024)
    with kernels("torch"):
        payload = sampled.compress(x)
    np.testing.assert_array_equal(_topk_indices(payload), _reference_topk(x, sampled.k_for(60_000)))


# ------------------------------------------------------------------------------------------
# Quantization
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_is_unbiased(bits, path):
    """Mean of R independent quantizations -> x, within 6 standard deviations per entry.

    Entry i rounds to one of two neighbouring levels (spacing scale/s) with probability p_i, so
    its variance is (scale/s)^2 p_i (1 - p_i); the mean of R draws has that / R.
    """
    n, bucket, repeats = 600, 50, 1500
    x = _randn(n, seed=bits) * torch.linspace(0.01, 3.0, n)
    c = build_compressor("quantization", bits=bits, bucket_size=bucket)
    # Every bucket is quantized with its own uniforms: R copies in one call = R independent draws.
    with kernels(path):
        out = c.decompress(c.compress(x.repeat(repeats), seed=42)).view(repeats, n)
    levels = 2 ** (bits - 1) - 1
    scale = x.view(-1, bucket).abs().amax(1).repeat_interleave(bucket)
    y = x.abs() / scale * levels
    p = y - y.floor()
    std_of_mean = (scale / levels) * torch.sqrt(p * (1 - p) / repeats)
    error = (out.double().mean(0) - x.double()).abs()
    worst = float((error - 6 * std_of_mean).max())
    assert bool((error <= 6 * std_of_mean + 1e-6 * scale).all()), worst
    # The squared error matches the exact variance sum_i (scale/s)^2 p_i (1-p_i) (within 5%),
    # which is within the QSGD bound min(n_b/s^2, sqrt(n_b)/s) ||x_b||^2 for every bucket.
    sq_error = ((out - x) ** 2).view(repeats, -1, bucket).sum(2).mean(0).double()
    expected = ((scale / levels) ** 2 * p * (1 - p)).view(-1, bucket).sum(1).double()
    assert torch.allclose(sq_error, expected, rtol=0.05, atol=1e-9)
    norm_sq = (x.view(-1, bucket).double() ** 2).sum(1)
    qsgd_bound = min(bucket / levels**2, math.sqrt(bucket) / levels) * norm_sq
    assert bool((sq_error <= qsgd_bound).all())


@pytest.mark.parametrize("path", PATHS)
@SETTINGS
@given(
    shape=st.lists(st.integers(1, 40), min_size=0, max_size=3),
    bits=st.sampled_from([2, 4, 8]),
    bucket_size=st.integers(1, 600),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_quantization_round_trip_shape_dtype_and_error_bound(path, shape, bits, bucket_size, seed, dtype):
    x = _randn(shape, seed, dtype)
    c = build_compressor("quantization", bits=bits, bucket_size=bucket_size)
    with kernels(path):
        payload = c.compress(x, seed=seed)
    out = decompress(payload)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert parse_header(payload).source_dtype == dtype
    # Stochastic rounding moves each entry by less than one level: |Q(x) - x| < scale / s.
    flat, ref = out.reshape(-1), x.float().reshape(-1)
    pad = -flat.numel() % bucket_size
    ref_b = torch.cat([ref, ref.new_zeros(pad)]).view(-1, bucket_size)
    err_b = torch.cat([flat - ref, ref.new_zeros(pad)]).view(-1, bucket_size)
    step = ref_b.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert bool((err_b.abs() <= step * (1 + 1e-5)).all())
    # The sign is kept: no entry flips sign.
    assert bool((flat * ref >= 0).all())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_of_zeros_stays_zero(bits, path):
    c = build_compressor("quantization", bits=bits, bucket_size=16)
    zeros = torch.zeros(3, 50)
    with kernels(path):
        out = decompress(c.compress(zeros))
    assert torch.equal(out, zeros) and bool(torch.isfinite(out).all())
    mixed = torch.zeros(64)
    mixed[20] = 5.0  # one nonzero bucket among zero buckets
    with kernels(path):
        out = decompress(c.compress(mixed, seed=0))
    assert bool(torch.isfinite(out).all())
    assert not out[:16].any() and not out[32:].any() and out[20] == 5.0  # max entry is exact


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_of_extreme_magnitudes_stays_finite_and_bounded(bits, path):
    # Denormal scales (levels / scale would overflow) and scales near float32's maximum.
    x = torch.tensor([1e-40, -3e-41, 0.0, 2e-45, 3e38, -1e38, 2.5e37, -3.3e38])
    c = build_compressor("quantization", bits=bits, bucket_size=4)
    for seed in range(20):
        with kernels(path):
            out = decompress(c.compress(x, seed=seed))
        assert bool(torch.isfinite(out).all())
        scale = x.view(2, 4).abs().amax(1, keepdim=True)
        step = scale / (2 ** (bits - 1) - 1)
        assert bool(((out - x).view(2, 4).abs() <= step * (1 + 1e-5)).all())
        torch.testing.assert_close(out[7], x[7], rtol=1e-6, atol=0)  # a bucket's max is kept


@pytest.mark.parametrize("path", PATHS)
def test_quantization_reproducible_with_seed_or_generator(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(compressor_base, "_use_host_path", lambda flat: False)
    c = build_compressor("quantization", bits=4)
    x = _randn(5000, seed=3)
    assert c.compress(x, seed=5) == c.compress(x, seed=5)
    assert c.compress(x, seed=5) != c.compress(x, seed=6)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert c.compress(x, g1) == c.compress(x, generator=g2)
    torch.manual_seed(1)
    first = c.compress(x)  # default: torch's global RNG
    torch.manual_seed(1)
    assert c.compress(x) == first
    with pytest.raises(ValueError, match="either generator or seed"):
        c.compress(x, g1, seed=1)


# ------------------------------------------------------------------------------------------
# Input conversion and bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_inputs_are_sent_as_float32(dtype):
    x = _randn((8, 9), seed=4, dtype=dtype)
    for c in (IDENTITY, build_compressor("topk", ratio=0.2)):
        payload = c.compress(x)
        assert parse_header(payload).source_dtype == dtype
        out = decompress(payload)
        assert out.dtype == torch.float32
        if c is IDENTITY:
            assert torch.equal(out, x.float())


def test_non_contiguous_and_requires_grad_inputs():
    base = _randn((30, 40), seed=5).requires_grad_(True)
    x = base.t()  # non-contiguous view
    for c in ALL_COMPRESSORS:
        out = decompress(c.compress(x, seed=0))
        assert out.shape == (40, 30)
    assert torch.equal(decompress(IDENTITY.compress(x)), x.detach())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("compressor", ALL_COMPRESSORS, ids=lambda c: repr(c))
@pytest.mark.parametrize(
    "tensor, match",
    [
        (torch.tensor([1.0, float("nan"), 2.0]), "non-finite values: 1 NaN and 0 Inf"),
        (torch.tensor([1.0, float("inf")]), "non-finite values: 0 NaN and 1 Inf"),
        (torch.tensor([-float("inf"), float("nan")]), "1 NaN and 1 Inf"),
        (torch.tensor([1e300, 1.0], dtype=torch.float64), r"1 Inf \(after conversion to float32\)"),
        (torch.zeros(0), "empty tensor"),
        (torch.zeros(3, 0), "empty tensor"),
        (torch.arange(5), "floating-point.*torch.int64"),
        (torch.ones(3, dtype=torch.bool), "floating-point.*torch.bool"),
        (torch.ones(3, dtype=torch.complex64), "floating-point.*complex64"),
        (torch.ones([1] * 9), "at most 8"),
        ([1.0, 2.0], "expects a torch.Tensor, got list"),
    ],
)
def test_bad_tensors_raise_value_error(compressor, tensor, match, path):
    with kernels(path), pytest.raises(ValueError, match=match):
        compressor.compress(tensor)


@pytest.fixture(params=ALL_COMPRESSORS, ids=lambda c: repr(c))
def payload(request):
    return request.param.compress(_randn((10, 13), seed=6), seed=0)


def test_truncated_payload_rejected(payload):
    with pytest.raises(ValueError, match="payload truncated"):
        decompress(payload[:-1])
    with pytest.raises(ValueError, match=f"shorter than the {HEADER_SIZE}-byte"):
        decompress(payload[: HEADER_SIZE - 1])
    with pytest.raises(ValueError, match="truncated"):
        decompress(b"")


def test_extended_payload_rejected(payload):
    with pytest.raises(ValueError, match="payload extended"):
        decompress(payload + b"\x00")


def test_every_garbled_header_byte_is_detected(payload):
    for position in range(HEADER_SIZE):
        garbled = bytearray(payload)
        garbled[position] ^= 0x5A
        with pytest.raises(ValueError, match="magic|version|checksum"):
            decompress(bytes(garbled))


def test_header_field_problems_are_named(payload):
    with pytest.raises(ValueError, match="bad payload magic"):
        decompress(b"XX" + payload[2:])
    with pytest.raises(ValueError, match="unsupported payload format version 7"):
        decompress(_rewrite_header(payload, version=7))
    with pytest.raises(ValueError, match="unknown compressor kind code 9"):
        decompress(_rewrite_header(payload, kind=9))
    with pytest.raises(ValueError, match="unknown source dtype code"):
        decompress(_rewrite_header(payload, dtype=200))
    with pytest.raises(ValueError, match="does not hold numel"):
        decompress(_rewrite_header(payload, numel=131))
    with pytest.raises(ValueError, match="malformed"):
        decompress(_rewrite_header(payload, ndim=9))


def test_payload_of_wrong_type_rejected():
    for bad in ("not bytes", [1, 2, 3], 12, torch.zeros(70)):
        with pytest.raises(ValueError, match="payload"):
            decompress(bad)


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_topk_entries_are_what_decompress_scatters_and_other_kinds_have_none(value_dtype):
    x = _randn(1000, seed=4)
    payload = build_compressor("topk", ratio=0.05, value_dtype=value_dtype).compress(x)
    positions, values = comp.topk_entries(payload)
    assert positions.dtype == np.int32 and values.dtype == np.float32 and len(positions) == 50
    assert (np.diff(positions) > 0).all()
    dense = torch.zeros(1000)
    dense[torch.from_numpy(positions.astype(np.int64))] = torch.from_numpy(values)
    assert torch.equal(dense, decompress(payload))
    assert comp.topk_entries(IDENTITY.compress(x)) is None
    assert comp.topk_entries(build_compressor("quantization", bits=8).compress(x, seed=0)) is None
    bad = bytearray(payload)
    struct.pack_into("<i", bad, HEADER_SIZE + (2 if value_dtype == "bfloat16" else 4) * 50, 5000)
    with pytest.raises(ValueError, match="indices are not strictly increasing"):  # checked as decompress checks
        comp.topk_entries(bytes(bad))


def test_garbled_buffers_rejected():
    x = _randn(100, seed=8)
    topk = bytearray(build_compressor("topk", ratio=0.1).compress(x))
    k = 10
    bad = bytearray(topk)
    struct.pack_into("<i", bad, HEADER_SIZE + 4 * k, 500)  # index out of range
    with pytest.raises(ValueError, match="indices"):
        decompress(bytes(bad))
    bad = bytearray(topk)
    first = struct.unpack_from("<i", bad, HEADER_SIZE + 4 * k)[0]
    struct.pack_into("<i", bad, HEADER_SIZE + 4 * k + 4, first)  # duplicate index
    with pytest.raises(ValueError, match="strictly increasing"):
        decompress(bytes(bad))
    bad = bytearray(topk)
    struct.pack_into("<f", bad, HEADER_SIZE, float("nan"))
    with pytest.raises(ValueError, match="NaN/Inf"):
        decompress(bytes(bad))

    ident = bytearray(IDENTITY.compress(x))
    struct.pack_into("<f", ident, HEADER_SIZE + 8, float("inf"))
    with pytest.raises(ValueError, match="NaN/Inf"):
        decompress(bytes(ident))

    for bits, bad_byte in ((8, 0x80), (4, 0xF0), (2, 0x03)):
        quant = bytearray(build_compressor("quantization", bits=bits).compress(x, seed=0))
        quant[-1] = bad_byte  # -128 / nibble 15 / 2-bit field 3: outside [-s, s]
        with pytest.raises(ValueError, match="out-of-range"):
            decompress(bytes(quant))
    quant = bytearray(build_compressor("quantization").compress(x, seed=0))
    struct.pack_into("<f", quant, HEADER_SIZE, float("nan"))
    with pytest.raises(ValueError, match="scales"):
        decompress(bytes(quant))
