"""torch_asgc.ddp on one in-process gloo rank: registration, byte counts, the ratio setter, exact resume, bad input.

The multi-rank behaviour of the same hooks is tests/test_ddp_hooks.py's (3 ranks, against the
compression API applied by hand) and tests/test_ddp_library_readme.py's (docs/library.md's example, 2
ranks under torchrun).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_asgc
from src.compression import HEADER_SIZE
from tests.test_ddp_hooks import single_rank_group  # noqa: F401  (a fixture)


class Regressor(nn.Module):
    """A model of the user's own (not in src/training/models.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(1).sin()


def _train(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
        optimizer.step()


def _setup(module: nn.Module, **options):
    model = DistributedDataParallel(module)
    hook = torch_asgc.register_compression_hook(model, "topk", **options)
    return model, hook, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)


def test_one_call_registers_the_compression_hook_and_counts_its_payloads(single_rank_group):
    module = Regressor()
    model, hook, optimizer = _setup(module, ratio=0.1, value_dtype="bfloat16", warmup_steps=1)
    assert (hook.name, hook.topk_ratio, hook.state.policy.compressor.value_dtype) == ("topk", 0.1, torch.bfloat16)
    _train(model, optimizer, range(3))
    assert hook.state.step == 3
    # one rank sends nothing; its payloads weigh 56 + 6 bytes per kept entry per unit (after 1 dense step)
    assert hook.stats.bytes_sent == 0
    units = [sum(dict(module.named_parameters())[name].numel() for name in unit) for unit in hook.state.segments]
    assert sum(units) == sum(p.numel() for p in module.parameters())
    compressed = sum(HEADER_SIZE + 6 * math.ceil(0.1 * n) for n in units)
    assert hook.stats.payload_bytes == 4 * sum(units) + 2 * compressed  # warm-up (dense) + 2 steps
    hook.set_topk_ratio(0.05)
    assert hook.topk_ratio == 0.05 and hook.state.policy.compressor.value_dtype == torch.bfloat16
    hook.close()


def test_the_hook_state_resumes_exactly_in_a_new_model(single_rank_group, tmp_path):
    uninterrupted_module = Regressor()
    model, hook, optimizer = _setup(uninterrupted_module, ratio=0.05)
    _train(model, optimizer, range(6))
    hook.close()

    first = Regressor()
    model, hook, optimizer = _setup(first, ratio=0.05)
    _train(model, optimizer, range(3))
    torch.save(
        {"model": first.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()},
        tmp_path / "ckpt.pt",
    )
    hook.close()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert max(float(r.abs().max()) for r in saved["hook"]["error_feedback"]["residuals"].values()) > 0

    resumed = Regressor()
    resumed.load_state_dict(saved["model"])
    model, hook, optimizer = _setup(resumed, ratio=0.05)
    optimizer.load_state_dict(saved["optimizer"])
    hook.load_state_dict(saved["hook"])
    _train(model, optimizer, range(3, 6))
    hook.close()
    for a, b in zip(resumed.parameters(), uninterrupted_module.parameters()):
        assert torch.equal(a, b)


def test_ring_hook_and_quantization_register_on_any_ddp_model(single_rank_group):
    module, reference = Regressor(), Regressor()
    model = DistributedDataParallel(module)
    ring = torch_asgc.register_ring_hook(model)
    assert (ring.name, ring.state_dict(), ring.topk_ratio) == ("ring", {}, None)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(module.parameters(), reference.parameters())
    )  # one rank: untouched
    ring.close()
    quantized = torch_asgc.register_compression_hook(DistributedDataParallel(Regressor()), "quantization", bits=4)
    assert quantized.name == "quantization" and quantized.topk_ratio is None
    with pytest.raises(ValueError, match="does not compress with top-k"):
        quantized.set_topk_ratio(0.1)
    built = torch_asgc.register_compression_hook(
        DistributedDataParallel(Regressor()), torch_asgc.build_compressor("topk", ratio=0.2)
    )
    assert built.topk_ratio == 0.2


def test_bad_arguments_are_named(single_rank_group):
    with pytest.raises(TypeError, match="must be a torch.nn.parallel.DistributedDataParallel, got Regressor"):
        torch_asgc.register_compression_hook(Regressor())
    with pytest.raises(TypeError, match="register_ring_hook"):
        torch_asgc.register_ring_hook(Regressor())
    model = DistributedDataParallel(Regressor())
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bits'\] for compressor 'topk'"):
        torch_asgc.register_compression_hook(model, "topk", bits=4)
    with pytest.raises(ValueError, match="topk.value_dtype must be one of"):
        torch_asgc.register_compression_hook(model, "topk", value_dtype="int8")
    with pytest.raises(ValueError, match="warmup_allreduce must be one of"):
        torch_asgc.register_compression_hook(model, warmup_allreduce="tree")
    with pytest.raises(ValueError, match="ready-made compressor"):
        torch_asgc.register_compression_hook(model, torch_asgc.build_compressor("topk"), ratio=0.5)
    with pytest.raises(ValueError, match="policy.warmup_steps"):
        torch_asgc.register_compression_hook(model, warmup_steps=-1)


def test_torch_asgc_exports_the_ddp_hooks():
    assert torch_asgc.ddp.register_compression_hook is torch_asgc.register_compression_hook
    assert {"ddp", "register_compression_hook", "register_ring_hook"} <= set(torch_asgc.__all__)
    assert torch_asgc.ddp.__doc__.startswith("torch_asgc.ddp:")
