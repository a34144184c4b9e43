"""Contract tests of the DDP comm hooks on real gloo groups.

One spawned 3-rank session (3 ranks: with 2 the ring's left and right neighbour are the same rank)
runs every multi-rank check and saves what it saw; the tests below assert on it. Each hook is
compared with an independent reference: ``dist.all_reduce`` for the ring, and the compression API
applied by hand (compensate -> compress -> decompress -> mean over ranks) for the compressed hook.
Byte counts are checked against the kernel's count of the TCP payload bytes each rank sent
(:func:`tests.ddp_fixtures.tcp_bytes`), not against the hooks' own formulas.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.compression import build_compressor, decompress
from src.compressors.policy import CompressionPolicy
from src.config import SystemConfig
from src.ddp.comm_hooks import RingHookState, comm_hook_from_config, compression_hook, ring_allreduce_hook
from src.ddp.comm_stats import CommStats, ring_allreduce_bytes
from src.ddp.hook_state import CompressionHookState
from src.ddp.ring_allreduce import ring_allreduce_
from tests.ddp_fixtures import join_group, spawn_ranks, tcp_bytes

WORLD = 3
RING_SIZES = [(1,), (2,), (3,), (7,), (10,), (999,), (1000,), (4099,), (6, 35)]
TOPK_WARMUP = 1
STEPS = 4
#: gloo's framing on top of the tensors handed to it (~300 bytes per message).
FRAMING_BYTES = 2048


def _tiny_model() -> nn.Module:
    # Biases of 30 and 4 entries are too small for top-k 0.25 to pay for its header: they travel
    # uncompressed (identity), so the mixed path is exercised too.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 20, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def _gather(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous())
    return out


def _ring_checks(rank: int, world: int) -> list[dict]:
    results = []
    for shape in RING_SIZES:
        generator = torch.Generator().manual_seed(sum(shape) * 31 + rank)
        tensor = torch.randn(*shape, generator=generator)
        expected = tensor.clone()
        dist.all_reduce(expected)
        got = tensor.clone()
        dist.barrier()
        before = tcp_bytes()
        sent, received = ring_allreduce_(got)
        after = tcp_bytes()
        results.append(
            {
                "shape": shape,
                "error": float((got - expected).abs().max()),
                "scale": float(expected.abs().max()),
                "sent": sent,
                "received": received,
                "wire_sent": after[0] - before[0],
            }
        )
    return results


def _ring_hook_check(rank: int, world: int) -> dict:
    plain_module, ring_module = _tiny_model(), _tiny_model()
    plain, ring = DistributedDataParallel(plain_module), DistributedDataParallel(ring_module)
    state = RingHookState()
    ring.register_comm_hook(state, ring_allreduce_hook)
    errors, wire = [], 0
    for step in range(3):  # iteration 0 uses one bucket, later ones the rebuilt buckets
        x, y = _batch(step, rank)
        for model in (plain, ring):
            model.zero_grad()
            dist.barrier()
            before = tcp_bytes()[0]
            F.cross_entropy(model(x), y).backward()
            if model is ring:
                wire += tcp_bytes()[0] - before
        errors.append(
            max(
                float((a.grad - b.grad).abs().max())
                for a, b in zip(plain_module.parameters(), ring_module.parameters())
            )
        )
        with torch.no_grad():
            for a, b in zip(plain_module.parameters(), ring_module.parameters()):
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad
    state.close()
    return {
        "errors": errors,
        "bytes_sent": state.stats.bytes_sent,
        "wire_sent": wire,
        "steps": state.step,
        "numel": sum(p.numel() for p in plain_module.parameters()),
    }


def _recording(hook):
    """Wrap ``hook`` to note each bucket's parameter names (DDP's layout, seen from outside the hook)."""
    layouts: list[list[tuple[int, ...]]] = [[]]

    def recorded(state, bucket):
        layouts[-1].append(tuple(id(p) for p in bucket.parameters()))
        if bucket.is_last():
            layouts.append([])
        return hook(state, bucket)

    return recorded, layouts


def _topk_by_hand(policy, step, names, grads, residuals):
    """The mean over ranks of what each rank sends for one bucket: its compensated gradients side by side
    (``grads[parameter][rank]`` plus its residuals), compressed as one flat tensor; updates ``residuals``."""
    world = len(residuals)
    expected = [torch.zeros_like(per_rank[0]) for per_rank in grads]
    for source in range(world):
        compensated = [
            grads[i][source] + residuals[source].get(name, torch.zeros_like(grads[i][source]))
            for i, name in enumerate(names)
        ]
        sent = decompress(policy.compress(torch.cat([c.reshape(-1) for c in compensated]), step)).split(
            [c.numel() for c in compensated]
        )
        for i, name in enumerate(names):
            residuals[source][name] = compensated[i] - sent[i].view(compensated[i].shape)
            expected[i] += sent[i].view(compensated[i].shape)
    return [e / world for e in expected]


def _compression_check(rank: int, world: int, kind: str) -> dict:
    """DDP + compression hook against the compression API applied by hand to every rank's gradient.

    The hand-made reference compresses each bucket DDP hands over as one flat tensor (its
    parameters' compensated gradients side by side, in bucket order) and keeps residuals per
    parameter: the hook's contract for a process that has not settled its buckets first.
    """
    module = _tiny_model()
    reference = copy.deepcopy(module)
    model = DistributedDataParallel(module)
    if kind == "topk":
        policy = CompressionPolicy(build_compressor("topk", ratio=0.25), warmup_steps=TOPK_WARMUP)
        use_ef = True
    else:
        policy = CompressionPolicy(build_compressor("quantization", bits=8, bucket_size=64))
        use_ef = False
    state = CompressionHookState(
        policy, param_names={id(p): n for n, p in module.named_parameters()}, error_feedback=use_ef
    )
    hook, layouts = _recording(compression_hook)
    model.register_comm_hook(state, hook)
    by_id = dict(zip((id(p) for p in module.parameters()), zip(reference.named_parameters(), module.parameters())))
    residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    steps = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        sent_before = state.stats.total_sent
        module.zero_grad()
        dist.barrier()
        wire_before = tcp_bytes()[0]
        F.cross_entropy(model(x), y).backward()
        wire_sent = tcp_bytes()[0] - wire_before
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        record = {"error": 0.0, "bound": 0.0, "changed": 0.0}
        for bucket in layouts[step]:
            named = [by_id[pid][0] for pid in bucket]
            got = [by_id[pid][1].grad for pid in bucket]
            grads = [_gather(local.grad, world) for _, local in named]  # [parameter][rank]
            true_means = [torch.stack(per_rank).mean(0) for per_rank in grads]
            if kind == "topk" and step >= TOPK_WARMUP:
                expected = _topk_by_hand(policy, step, [name for name, _ in named], grads, residuals)
            else:
                expected = true_means
            for got_grad, expected_grad, true_mean, per_rank in zip(got, expected, true_means, grads):
                record["error"] = max(record["error"], float((got_grad - expected_grad).abs().max()))
                record["changed"] = max(record["changed"], float((got_grad - true_mean).abs().max()))
                if kind == "quantization":
                    # Each rank's entry is off by less than one level of its bucket scale (<= its max |g|).
                    record["bound"] = max(record["bound"], sum(float(g.abs().max()) for g in per_rank) / 127 / world)
        record["bytes"] = state.stats.total_sent - sent_before
        record["wire_sent"] = wire_sent
        record["compressed"] = step >= policy.warmup_steps
        steps.append(record)
        with torch.no_grad():  # keep the reference replica on the same parameters
            for got, local in zip(module.parameters(), reference.parameters()):
                got -= 0.1 * got.grad
                local.copy_(got)
    state.close()
    saved = state.state_dict()
    kept = (saved["error_feedback"] or {}).get("residuals", {})
    return {
        "steps": steps,
        "state_step": saved["step"],
        "residual_keys": sorted(kept),
        "layouts": [[len(bucket) for bucket in step] for step in layouts[:STEPS]],
        "residual_matches": all(
            name in kept and torch.allclose(kept[name], residual, atol=1e-6)
            for name, residual in residuals[rank].items()
        ),
    }


def _train_steps(
    model: DistributedDataParallel, module: nn.Module, rank: int, steps: range
) -> list[list[torch.Tensor]]:
    """Plain SGD steps on ``model``; returns each step's averaged gradients."""
    seen = []
    for step in steps:
        x, y = _batch(step, rank)
        module.zero_grad()
        F.cross_entropy(model(x), y).backward()
        seen.append([p.grad.clone() for p in module.parameters()])
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
    return seen


def _overlap_check(rank: int, world: int) -> dict:
    """Each hook returning its future at once (exchange on its thread) == the same hook run inline."""
    differences = {}
    for kind in ("ring", "topk"):
        grads = []
        for overlap in (True, False):
            module = _tiny_model()
            system = (
                SystemConfig(allreduce="ring")
                if kind == "ring"
                else SystemConfig(
                    compression_enabled=True, compression_type="topk", compression_ratio=0.25, warmup_steps=1
                )
            )
            hook = comm_hook_from_config(system, module, overlap=overlap)
            model = DistributedDataParallel(module)
            hook.register(model)
            grads.append(_train_steps(model, module, rank, range(4)))
            hook.close()
        differences[kind] = max(
            float((a - b).abs().max()) for step_a, step_b in zip(*grads) for a, b in zip(step_a, step_b)
        )
    return differences


def _resume_check(rank: int, world: int) -> dict:
    """A new process (new DDP: one provisional bucket first) resumed from the hook's state == going on."""
    system = SystemConfig(compression_enabled=True, compression_type="topk", compression_ratio=0.25)
    module = _tiny_model()
    hook = comm_hook_from_config(system, module)
    model = DistributedDataParallel(module)
    hook.register(model)
    _train_steps(model, module, rank, range(2))
    saved, parameters = hook.state_dict(), copy.deepcopy(module.state_dict())
    going_on = _train_steps(model, module, rank, range(2, 4))
    hook.close()

    resumed_module = _tiny_model()
    resumed_module.load_state_dict(parameters)
    resumed_hook = comm_hook_from_config(system, resumed_module)
    resumed_hook.load_state_dict(saved)
    resumed = DistributedDataParallel(resumed_module)
    resumed_hook.register(resumed)
    again = _train_steps(resumed, resumed_module, rank, range(2, 4))
    resumed_hook.close()
    return {
        "segments": saved["segments"],
        "difference": max(
            float((a - b).abs().max()) for step_a, step_b in zip(going_on, again) for a, b in zip(step_a, step_b)
        ),
    }


def _hook_session(rank: int, world: int, port: int, out_dir: str) -> None:
    join_group(rank, world, port)
    try:
        results = {
            "ring": _ring_checks(rank, world),
            "ring_hook": _ring_hook_check(rank, world),
            "topk": _compression_check(rank, world, "topk"),
            "quantization": _compression_check(rank, world, "quantization"),
            "overlap": _overlap_check(rank, world),
            "resume": _resume_check(rank, world),
        }
        torch.save(results, Path(out_dir) / f"rank_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_hooks")
    spawn_ranks(_hook_session, WORLD, str(out))
    return [torch.load(out / f"rank_{rank}.pt", weights_only=False) for rank in range(WORLD)]


# ----------------------------------------------------------------------------- ring


@pytest.mark.slow
def test_ring_allreduce_equals_dist_all_reduce(session):
    for rank, results in enumerate(session):
        for check in results["ring"]:
            assert check["error"] <= 1e-5 * max(1.0, check["scale"]), (rank, check)


@pytest.mark.slow
def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_tensor(session):
    for check_index, shape in enumerate(RING_SIZES):
        numel = torch.Size(shape).numel()
        chunks = [len(c) for c in torch.arange(numel).tensor_split(WORLD)]
        for rank, results in enumerate(session):
            check = results["ring"][check_index]
            # reduce-scatter sends every chunk but (r+1)'s, all-gather every chunk but (r+2)'s
            expected = 4 * (2 * numel - chunks[(rank + 1) % WORLD] - chunks[(rank + 2) % WORLD])
            assert check["sent"] == expected, (shape, rank)
            # ... and receives every chunk but r's, then every chunk but (r+1)'s
            assert check["received"] == 4 * (2 * numel - chunks[rank] - chunks[(rank + 1) % WORLD]), (shape, rank)
            if numel % WORLD == 0:
                assert check["sent"] == ring_allreduce_bytes(WORLD, 4 * numel) == 2 * (WORLD - 1) * 4 * numel // WORLD
            # ... which is what the kernel saw leave the process, give or take gloo's framing
            assert 0 <= check["wire_sent"] - check["sent"] <= FRAMING_BYTES, (shape, rank, check)
        assert sum(r["ring"][check_index]["sent"] for r in session) == sum(
            r["ring"][check_index]["received"] for r in session
        )


@pytest.mark.slow
def test_ring_hook_matches_default_ddp_allreduce(session):
    for results in session:
        hook = results["ring_hook"]
        assert max(hook["errors"]) <= 1e-6
        assert hook["steps"] == 3
        # every step, every bucket: 2(N-1)/N of the gradient bytes, counted from what was sent ...
        assert hook["bytes_sent"] == pytest.approx(
            3 * ring_allreduce_bytes(WORLD, 4 * hook["numel"]), abs=3 * 4 * 2 * WORLD
        )
        # ... which is what the kernel saw leave the process, give or take gloo's framing
        assert 0 <= hook["wire_sent"] - hook["bytes_sent"] <= 3 * FRAMING_BYTES


# ----------------------------------------------------------------------------- compression


@pytest.mark.slow
def test_topk_hook_matches_compression_api_with_error_feedback(session):
    for results in session:
        topk = results["topk"]
        for step, record in enumerate(topk["steps"]):
            assert record["error"] <= 1e-6, (step, record)
        # after warm-up the result really is compressed (differs from the true mean)
        assert all(record["changed"] > 1e-4 for record in topk["steps"][TOPK_WARMUP:])
        assert topk["steps"][0]["changed"] <= 1e-6
        assert topk["state_step"] == STEPS
        assert topk["residual_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert topk["residual_matches"]


@pytest.mark.slow
def test_compression_units_follow_ddp_buckets(session):
    for results in session:
        # the first pass has DDP's single provisional bucket, later ones the rebuilt one (here also one)
        assert results["topk"]["layouts"] == [[4]] * STEPS


@pytest.mark.slow
def test_overlapping_hooks_equal_the_synchronous_ones(session):
    for results in session:
        assert results["overlap"] == {"ring": 0.0, "topk": 0.0}


@pytest.mark.slow
def test_hook_state_resumes_exactly_in_a_new_ddp_process(session):
    for results in session:
        # the rebuilt bucket (reverse order) is the learned unit; the resumed process's first,
        # provisional bucket (forward order) is compressed in that unit's order
        assert results["resume"]["segments"] == [["2.bias", "2.weight", "0.bias", "0.weight"]]
        assert results["resume"]["difference"] == 0.0


@pytest.mark.slow
def test_quantization_hook_error_is_within_one_level(session):
    for results in session:
        for record in results["quantization"]["steps"]:
            assert 0 < record["changed"] <= record["bound"] + 1e-7, record


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["topk", "quantization"])
def test_hook_counts_the_bytes_the_kernel_saw_sent(session, kind):
    # The hook's count against the kernel's count of this process's TCP payload bytes in the same
    # backward pass: independent of the hook's own arithmetic. (Whether compression pays is shown
    # on a real model in test_ddp_trainer: this one is too small for gloo's framing.)
    for results in session:
        records = results[kind]["steps"]
        for record in records:
            assert 0 <= record["wire_sent"] - record["bytes"] <= FRAMING_BYTES, record
        assert any(record["compressed"] for record in records)


# ----------------------------------------------------------------------------- single rank, in process


@pytest.fixture
def single_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "fields, name",
    [
        ({}, "allreduce"),
        ({"allreduce": "ring"}, "ring"),
        ({"compression_enabled": True, "compression_type": "topk"}, "topk"),
        ({"compression_enabled": True, "compression_type": "quantization", "allreduce": "ring"}, "quantization"),
    ],
)
@pytest.mark.slow
def test_comm_hook_from_config_on_one_rank_leaves_gradients_alone(single_rank_group, fields, name):
    system = SystemConfig(**{**fields, "compression_ratio": 1.0})
    module = _tiny_model()
    reference = copy.deepcopy(module)
    hook = comm_hook_from_config(system, module)
    assert hook.name == name
    model = DistributedDataParallel(module)
    hook.register(model)
    for step in range(2):
        x, y = _batch(step, 0)
        module.zero_grad()
        reference.zero_grad()
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(reference(x), y).backward()
        hook.end_step()
        # one rank, top-k keeping everything / 8-bit quantization: (nearly) the gradient itself; a
        # quantization bucket can span parameters, so its scale is the segment's (here the model's) largest
        largest = max(float(b.grad.abs().max()) for b in reference.parameters())
        for a, b in zip(module.parameters(), reference.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=2e-2 * largest + 1e-7)
    hook.close()
    assert hook.stats.total_sent == 0  # nobody to send to


def test_ring_allreduce_bytes_formula():
    assert ring_allreduce_bytes(1, 1000) == 0
    assert ring_allreduce_bytes(2, 1000) == 1000
    assert ring_allreduce_bytes(4, 1000) == 1500


def test_comm_stats_accounting_names_what_was_measured():
    stats = CommStats()
    assert stats.accounting() == "none"
    stats.estimated(10, 10)
    assert stats.accounting() == "estimated"
    stats.measured(5, 5)
    assert (stats.accounting(), stats.total_sent) == ("mixed", 15)


def test_compression_state_rejects_residuals_of_unknown_parameters():
    policy = CompressionPolicy(build_compressor("topk", ratio=0.1))
    state = CompressionHookState(policy, param_names={1: "weight"})
    good = state.state_dict()
    good["error_feedback"]["residuals"] = {"weight": torch.zeros(3)}
    state.load_state_dict(good)
    assert torch.equal(state.error_feedback.residual("weight"), torch.zeros(3))
    bad = state.state_dict()
    bad["error_feedback"]["residuals"] = {"bias": torch.zeros(3)}
    with pytest.raises(ValueError, match="unknown parameters: bias"):
        state.load_state_dict(bad)
