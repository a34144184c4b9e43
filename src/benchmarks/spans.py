"""What the timeline spans and the exposed-communication measurement cost a training step: a span or record
with no tracer, a recorded span, one BackwardWait hook, and a DDP step with and without BackwardWait.
``scripts/bench_spans.py`` runs it (the figures docs/observability.md quotes).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


def _per_call_us(function, calls: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of five: the least disturbed by other processes
        started = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def span_costs(calls: int) -> dict[str, float]:
    from src.telemetry import tracing

    def span() -> None:
        with tracing.span("x", step=1):
            pass

    def record() -> None:
        tracing.record("x", 1.0, 2.0, step=1)

    costs = {"span_off_us": _per_call_us(span, calls), "record_off_us": _per_call_us(record, calls)}
    with tempfile.TemporaryDirectory() as folder, tracing.trace_to(Path(folder) / tracing.TRACE_FILE, "bench"):
        costs["span_on_us"] = _per_call_us(span, calls // 10)
    return costs


def hook_cost_us(calls: int) -> float:
    """Per parameter: a backward pass over 8 one-element parameters, with the hooks minus without, / 8."""
    import torch
    from torch import nn

    from src.telemetry.exposed_comm import BackwardWait

    module = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(8)])

    def backward() -> None:
        sum(p.sum() for p in module).backward()

    without = _per_call_us(backward, calls)
    wait = BackwardWait(module)
    with_hooks = _per_call_us(backward, calls)
    wait.close()
    return (with_hooks - without) / 8


def ddp_step_costs(steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from src.telemetry.exposed_comm import BackwardWait
    from src.training.data import load_dataset
    from src.training.models import build_model

    torch.set_num_threads(1)
    data = load_dataset("mnist_5k", "train", max_samples=64)
    images, labels = data.batch(list(range(64)))
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), 1), rank=0, world_size=1)
        try:
            module = build_model("simple_cnn", data.info)
            model = DistributedDataParallel(module)
            timings: dict[bool, list[float]] = {True: [], False: []}
            for step in range(2 * steps + 10):
                measured = step % 2 == 0
                wait = BackwardWait(module) if measured else None  # its hooks are on for this step only
                started = time.perf_counter()
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(images), labels)
                if wait is not None:
                    wait.backward_started()
                loss.backward()
                if wait is not None:
                    wait.backward_ended(time.perf_counter())
                elapsed_ms = (time.perf_counter() - started) * 1e3
                if wait is not None:
                    wait.close()
                if step >= 10:  # warm-up steps are not counted
                    timings[measured].append(elapsed_ms)
        finally:
            dist.destroy_process_group()
    with_wait, without = statistics.median(timings[True]), statistics.median(timings[False])
    parameters = sum(1 for p in module.parameters() if p.requires_grad)
    return {
        "ddp_step_ms_with_backward_wait": with_wait,
        "ddp_step_ms_without": without,
        "parameters_hooked": parameters,
    }


def run_benchmark(calls: int, steps: int) -> dict[str, float]:
    """Every figure: spans and records timed ``calls`` times, the hook ``calls // 50``, DDP ``steps`` steps."""
    return {
        **span_costs(calls),
        "backward_wait_hook_us_per_parameter": hook_cost_us(calls // 50),
        **ddp_step_costs(steps),
    }
