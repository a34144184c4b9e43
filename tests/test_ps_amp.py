"""Mixed precision in the parameter-server worker (training.amp, src/ps/worker/compute.py, src/trainer.py
MixedPrecision).

Claims: ``--amp bf16`` trains within 1 point of float32 (one-sided, as tests/test_ddp_precision.py),
the server's parameters and checkpoint stay float32; under fp16 a gradient that overflowed is not
pushed: its batch is computed again at the scale the GradScaler lowered (the planned work covers
every sample once), and what is pushed is the true, finite gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src import parameter_server_pb2 as pb
from src.common.checkpoint import load_checkpoint
from src.coordinator import check_coverage
from src.metrics import MetricsLogger, read_events
from src.ps.worker.compute import WorkerCompute
from src.trainer import MixedPrecision, forward_backward, model_from_config
from src.training.data import load_dataset
from src.virtual.run import run_virtual
from tests.ps_fixtures import ps_config

pytestmark = pytest.mark.timeout(300)

ONE_POINT = 0.01
RUN = dict(
    system__clock="virtual",
    system__num_workers=1,
    system__aggregation_mode="sync",
    training__num_epochs=2,
    training__batch_size=64,
    training__max_train_samples=None,
    training__max_test_samples=None,
    training__model_architecture="mlp",
    emulation__compute_s=0.02,
    emulation__server_update_s=0.002,
    emulation__server_reply_s=0.001,
)


@pytest.mark.slow  # two whole runs (~11 s), like the other runners' accuracy bars (tests/test_ddp_precision.py)
def test_bf16_workers_train_within_one_point_of_float32(tmp_path):
    """mnist_5k, 2 epochs, one worker x batch 64 (the mlp keeps it to seconds); the server stays float32."""
    summaries = {}
    for amp in ("none", "bf16"):
        config = ps_config(tmp_path, amp, training__amp=amp, **RUN)
        summaries[amp] = run_virtual(config, tensorboard=False)
        assert check_coverage(read_events(Path(config.system.log_dir) / "server" / "events.jsonl"), 4000, 2)["ok"]
    full, half = summaries["none"]["final_accuracy"], summaries["bf16"]["final_accuracy"]
    print(f"PS test accuracy: float32 {full:.4f}, bf16 autocast {half:.4f}")
    assert full > 0.85 and half >= full - ONE_POINT, (full, half)
    state = load_checkpoint(summaries["bf16"]["checkpoint_path"])["model_state_dict"]
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}


def test_an_fp16_gradient_that_overflowed_is_computed_again_and_the_finite_one_is_kept(tmp_path):
    """A loss scale of 2**24 overflows float16 at once: the worker lowers it and computes the batch again;
    the gradient it keeps is the one float16 autocast gives at a scale that never overflowed (2**10)."""
    config = ps_config(tmp_path, "fp16", training__amp="fp16", training__model_architecture="mlp")
    train_set = load_dataset("mnist_5k", "train", max_samples=64)
    batch = pb.Batch(batch_id=7, epoch=0, indices=list(range(32)))
    model = model_from_config(config)
    reference = model_from_config(config)
    reference.load_state_dict(model.state_dict())
    with MetricsLogger(tmp_path / "worker_0", tensorboard=False) as log:
        step = WorkerCompute(config, 0, model=model, train_set=train_set, device=torch.device("cpu"), log=log)
        step.amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        step.compute([batch], 0, 1)
    overflows = list(read_events(tmp_path / "worker_0" / "events.jsonl", "amp_overflow"))
    assert overflows and all(e["batch_id"] == 7 for e in overflows)
    assert step.amp.scaler.get_scale() < 2.0**24 and step.amp.skipped_steps == len(overflows)

    safe = MixedPrecision("fp16", torch.device("cpu"))
    safe.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    images, labels = train_set.batch(list(batch.indices))
    forward_backward(reference, images, labels, safe)
    assert safe.unscale(list(reference.parameters()))
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(param.grad).all(), name
        error = (param.grad - expected.grad).norm() / expected.grad.norm()
        assert error < 1e-3, (name, float(error))
