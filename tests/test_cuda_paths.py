"""The CUDA paths, against the CPU ones: compression kernels, the DDP hooks on nccl, mixed precision.

Run where a GPU is present (``scripts/gpu_check.sh`` runs this file and the runners on CUDA); on a
machine without one every test is skipped, saying so. What is compared:

* top-k on CUDA (torch kernels, ``_device_sampled_topk``) sends byte for byte the CPU payload (numpy
  kernels), in both selection modes and with float32 or bfloat16 values;
* quantization on CUDA draws its own random rounding, so it is held to the same scales, codes within
  one level of the CPU's, and an unbiased mean;
* the compression and ring hooks on an nccl group of one rank leave the gradient as it is (top-k
  keeping everything, 8-bit quantization within a level), with exact payload byte counts;
* ``MixedPrecision``: bf16 autocast computes in bfloat16 on CUDA; fp16's GradScaler skips an
  overflowed step and leaves the parameters untouched.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_asgc
from src.compression import HEADER_SIZE, build_compressor, decompress, parse_header
from src.trainer import MixedPrecision

# scripts/gpu_check.sh sets DTS_REQUIRE_CUDA=1: there a missing GPU fails the tests instead of skipping them.
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("DTS_REQUIRE_CUDA") != "1",
    reason="needs a CUDA device: scripts/gpu_check.sh runs these where one is lent",
)

CUDA = torch.device("cuda", 0)


def _randn(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("selection", ["sampled", "exact"])
@pytest.mark.parametrize("numel, ratio", [(1000, 0.1), (1 << 20, 0.01), (11_000_000, 0.001)])
def test_topk_kernels_on_cuda_send_exactly_the_cpu_payload(numel, ratio, selection, value_dtype):
    compressor = build_compressor("topk", ratio=ratio, selection=selection, value_dtype=value_dtype)
    x = _randn(numel, seed=numel)
    assert compressor.compress(x.to(CUDA)) == compressor.compress(x)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantization_on_cuda_keeps_the_cpu_scales_and_lands_within_one_level(bits):
    compressor = build_compressor("quantization", bits=bits, bucket_size=512)
    x = _randn(100_003, seed=bits)
    cpu_payload, gpu_payload = compressor.compress(x, seed=0), compressor.compress(x.to(CUDA), seed=0)
    header = parse_header(cpu_payload)
    assert parse_header(gpu_payload) == header
    buckets = -(-x.numel() // 512)
    scales = slice(HEADER_SIZE, HEADER_SIZE + 4 * buckets)
    assert gpu_payload[scales] == cpu_payload[scales]  # max |x| per bucket, exactly
    level = (
        torch.frombuffer(bytearray(cpu_payload[scales]), dtype=torch.float32).repeat_interleave(512)[: x.numel()]
        / compressor.levels
    )
    assert ((decompress(gpu_payload) - decompress(cpu_payload)).abs() <= level * (1 + 1e-5)).all()
    draws = torch.stack([decompress(compressor.compress(x.to(CUDA), seed=seed)) for seed in range(64)])
    assert (draws.mean(0) - x).abs().mean() <= 0.1 * level.mean()  # unbiased: the mean of 64 draws is close to x


@pytest.fixture
def nccl_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(CUDA)


@pytest.mark.parametrize("kind", ["topk", "quantization", "ring"])
def test_hooks_on_nccl_with_one_rank_leave_the_gradient_alone(nccl_group, kind):
    module = _model()
    reference = copy.deepcopy(module)
    model = DistributedDataParallel(module, device_ids=[0])
    if kind == "ring":
        hook = torch_asgc.register_ring_hook(model)
    elif kind == "topk":
        hook = torch_asgc.register_compression_hook(model, "topk", ratio=1.0)
    else:
        hook = torch_asgc.register_compression_hook(model, "quantization", bits=8)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(32, 64, generator=generator).to(CUDA),
            torch.randint(0, 10, (32,), generator=generator).to(CUDA),
        )
        module.zero_grad()
        reference.zero_grad()
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(reference(x), y).backward()
        largest = max(float(p.grad.abs().max()) for p in reference.parameters())
        # top-k keeping every entry in float32, and the ring on one rank: the gradient itself (up to
        # the last bit of a separately computed reference); 8-bit quantization: within a level
        tolerance = (2e-2 if kind == "quantization" else 1e-6) * largest
        for a, b in zip(module.parameters(), reference.parameters()):
            assert a.grad.device == CUDA and float((a.grad - b.grad).abs().max()) <= tolerance
    hook.close()


def test_bf16_values_on_nccl_are_6_bytes_per_kept_entry(nccl_group):
    module = _model()
    model = DistributedDataParallel(module, device_ids=[0])
    hook = torch_asgc.register_compression_hook(model, "topk", ratio=0.25, value_dtype="bfloat16")

    def step() -> None:
        module.zero_grad()
        F.cross_entropy(
            model(torch.randn(8, 64, device=CUDA)), torch.zeros(8, dtype=torch.long, device=CUDA)
        ).backward()

    step()
    step()  # from the second pass on, DDP's rebuilt buckets are the compression units
    before = hook.stats.payload_bytes
    step()
    sizes = {name: p.numel() for name, p in module.named_parameters()}
    expected = sum(
        HEADER_SIZE + 6 * math.ceil(0.25 * sum(sizes[name] for name in unit)) for unit in hook.state.segments
    )
    assert hook.stats.payload_bytes - before == expected
    hook.close()


def test_mixed_precision_on_cuda():
    model = _model()
    amp = MixedPrecision("bf16", CUDA)
    with amp.autocast():
        assert model(torch.randn(4, 64, device=CUDA)).dtype == torch.bfloat16
    fp16 = MixedPrecision("fp16", CUDA)
    fp16.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**60)  # float16 gradients overflow at this scale
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with fp16.autocast():
        loss = F.cross_entropy(model(torch.randn(16, 64, device=CUDA)), torch.zeros(16, dtype=torch.long, device=CUDA))
    fp16.backward(loss)
    assert fp16.step(optimizer) is False and fp16.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert fp16.state_dict()["scale"] == 2.0**59
