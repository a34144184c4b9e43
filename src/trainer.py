"""Baseline single-process trainer, and the train/eval pieces the distributed trainers reuse.

The baseline is the reference every distributed result is checked against: an epoch reads the
seeded permutation of :func:`src.training.data.epoch_permutation` in batches of ``training.batch_size``, so
sync PS with N workers of batch b, or DDP with N ranks of batch b, should match this trainer with
batch N*b. It evaluates on the test split after every epoch (and every ``training.eval_interval``
steps when set), checkpoints every ``training.checkpoint_interval`` epochs and at the end, and
resumes exactly from any checkpoint.

Time is kept by a :class:`TrainingClock`: it starts at the first training step and stops while the
model is evaluated or checkpointed, so throughput and time to target accuracy
(:class:`src.metrics.TimeToTarget`) measure training alone; summaries say so in their ``clock`` field.

Mixed precision (``training.amp``, :class:`MixedPrecision`, shared with the DDP trainer): ``bf16``
runs the forward pass and the loss under ``torch.autocast`` in bfloat16 (float32's range: no loss
scaling needed); ``fp16`` in float16 with a ``GradScaler``, which skips a step whose gradients
overflowed and lowers its scale. The parameters, the optimizer's state, the gradients the
optimizer sees and the checkpoints stay float32; evaluation runs in float32.

:func:`evaluate_checkpoint` scores any architecture's checkpoint on a test split
(``scripts/evaluate_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from src.common.checkpoint import (
    KEEP_CHECKPOINTS,
    check_model_matches,
    final_checkpoint_path,
    load_checkpoint,
    load_latest_good,
    make_checkpoint,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)
from src.config import Config, SetupError
from src.metrics import LOG_EVERY_STEPS, MetricsLogger, TimeToTarget, write_summary
from src.telemetry import tracing
from src.telemetry.trackers import open_trackers
from src.training.data import TensorDataset, dataset_info, epoch_permutation, load_dataset
from src.training.lr_schedule import set_scheduled_learning_rate
from src.training.models import build_model
from src.training.optimizers import build_optimizer, optimizer_from_config  # noqa: F401  (re-exported: the runners' registry)

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"training.device: {name} requested but CUDA is not available")
    return device


def model_from_config(config: Config) -> nn.Module:
    """The configured model, with parameters initialised from ``training.seed``."""
    torch.manual_seed(config.training.seed)
    return build_model(config.training.model_architecture, dataset_info(config.training.dataset))


def load_split(config: Config, split: str) -> TensorDataset:
    """The ``split`` ("train" or "test") as the config asks (subset size, synthetic size and seed)."""
    t = config.training
    max_samples = t.max_train_samples if split == "train" else t.max_test_samples
    return load_dataset(
        t.dataset, split, data_dir=t.data_dir, max_samples=max_samples, num_samples=t.num_samples, seed=t.seed
    )


def load_splits(config: Config) -> tuple[TensorDataset, TensorDataset]:
    """Train and test splits as the config asks (subset sizes, synthetic size and seed)."""
    return load_split(config, "train"), load_split(config, "test")


def checkpoint_of_run(
    config: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    step: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The common checkpoint dict for ``model`` and ``optimizer`` in a run of ``config``."""
    return make_checkpoint(
        model_state_dict=model.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
        model_architecture=config.training.model_architecture,
        dataset=config.training.dataset,
        epoch=epoch,
        step=step,
        config=config.to_dict(),
        extra=extra,
    )


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``training.amp`` -> the dtype autocast computes in."""


class _NoStep(torch.optim.Optimizer):
    """A GradScaler's bookkeeping for gradients that are applied elsewhere: its step does nothing."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):  # type: ignore[override]
        return None


class MixedPrecision:
    """``training.amp`` for a loop that runs the model itself: autocast, and a GradScaler for fp16.

    ``with amp.autocast():`` around the forward pass and the loss, ``amp.backward(loss)``, then
    ``amp.step(optimizer)``, which says whether the optimizer stepped (fp16: not when the gradients
    overflowed). With ``none`` all three are the plain calls. Under DDP every rank holds the same
    averaged gradients, so every rank's scaler finds the same overflow and skips the same steps.
    A loop whose optimizer steps elsewhere (a parameter-server worker) calls :meth:`unscale` instead
    of :meth:`step`: the true gradients in ``.grad``, or False when they overflowed.

    Args:
        mode: ``none``, ``bf16`` or ``fp16``.
        device: where the model runs (autocast and the scaler are per device type).
    """

    def __init__(self, mode: str, device: torch.device):
        if mode != "none" and mode not in AMP_DTYPES:
            raise ValueError(f"training.amp: must be one of none, {', '.join(AMP_DTYPES)}, got {mode!r}")
        self.mode = mode
        self.device_type = torch.device(device).type
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None
        self.skipped_steps = 0
        """Optimizer steps the scaler skipped (overflowed float16 gradients)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=AMP_DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` (through the scaler under fp16); False when the scaler skipped it."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() lowers the scale exactly when the step found inf/NaN gradients and was skipped.
        stepped = self.scaler.get_scale() >= scale
        self.skipped_steps += not stepped
        return stepped

    def unscale(self, params: list[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` by the loss scale and update the scale, as :meth:`step` does
        without stepping an optimizer; False when they overflowed (inf/NaN: the scale is lowered and the
        gradients are not usable). True at once without a scaler (bf16, none)."""
        if self.scaler is None:
            return True
        if getattr(self, "_holder_params", None) is not params:  # one bookkeeping optimizer per parameter list
            self._holder, self._holder_params = _NoStep(params), params
        scale = self.scaler.get_scale()
        self.scaler.unscale_(self._holder)
        self.scaler.step(self._holder)  # a no-op step; the scaler records the inf check it needs for update()
        self.scaler.update()
        finite = self.scaler.get_scale() >= scale  # update() lowers the scale exactly when it found inf/NaN
        self.skipped_steps += not finite
        return finite

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state (scale, growth tracker) for a checkpoint's ``extra``; ``None`` without one."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Continue from :meth:`state_dict` (nothing to do without a scaler, or without a saved state)."""
        if self.scaler is not None and saved:
            self.scaler.load_state_dict(saved)

    def summary(self) -> dict[str, Any]:
        """``amp`` and ``amp_skipped_steps`` for a run summary."""
        return {"amp": self.mode, "amp_skipped_steps": self.skipped_steps}


def forward_backward(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, amp: MixedPrecision | None = None
) -> tuple[float, int]:
    """One forward and backward pass, leaving gradients in ``.grad``; returns (mean loss, correct).

    ``amp``: run the forward under its autocast and scale the loss for the backward (fp16).
    """
    with amp.autocast() if amp is not None else contextlib.nullcontext():
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
    if amp is not None:
        amp.backward(loss)
    else:
        loss.backward()
    correct = int((logits.detach().argmax(dim=1) == labels).sum())
    return float(loss.detach()), correct


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: TensorDataset, *, batch_size: int = 1000, device: torch.device | str = "cpu"
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on all of ``dataset``."""
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        images = dataset.images[start : start + batch_size].to(device)
        labels = dataset.labels[start : start + batch_size].to(device)
        logits = model(images)
        total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
    model.train(was_training)
    count = max(len(dataset), 1)
    return total_loss / count, correct / count


def evaluate_checkpoint(
    path: str | Path,
    *,
    dataset: str | None = None,
    data_dir: str | Path = "./data",
    max_test_samples: int | None = None,
    batch_size: int = 1000,
) -> dict[str, Any]:
    """Score any checkpoint (baseline, parameter server or DDP) on a dataset's test split (default: its own).

    Returns ``{"accuracy", "loss", "num_samples", "dataset", "checkpoint"}``. Raises
    :class:`src.common.checkpoint.CheckpointError` for an unreadable file, ``ValueError`` when the dataset's
    samples do not fit the checkpoint's model, :class:`src.training.data.DatasetUnavailableError` when its files
    are missing. A synthetic test split is regenerated with the size and seed the run trained with.
    """
    checkpoint = load_checkpoint(path)
    name = dataset or checkpoint["dataset"]
    info, trained_on = dataset_info(name), dataset_info(checkpoint["dataset"])
    if (info.channels, info.height, info.width, info.num_classes) != (
        trained_on.channels,
        trained_on.height,
        trained_on.width,
        trained_on.num_classes,
    ):
        raise ValueError(f"--dataset {name}: samples do not fit a model trained on {checkpoint['dataset']}")
    model = build_model(checkpoint["model_architecture"], trained_on)
    model.load_state_dict(checkpoint["model_state_dict"])
    synthetic = checkpoint["config"].get("training", {})
    test = load_dataset(
        name,
        "test",
        data_dir=data_dir,
        max_samples=max_test_samples,
        num_samples=synthetic.get("num_samples", 2048),
        seed=synthetic.get("seed", 0),
    )
    loss, accuracy = evaluate(model, test, batch_size=batch_size)
    return {"accuracy": accuracy, "loss": loss, "num_samples": len(test), "dataset": name, "checkpoint": str(path)}


class TrainingClock:
    """Seconds spent training: runs from the first training step, stopped while evaluating or checkpointing.

    ``with clock.running():`` around the training loop, ``with clock.paused():`` around the
    evaluations and checkpoints inside it; :attr:`seconds` can be read at any time.
    """

    DESCRIPTION = "from the first training step; evaluation and checkpoints excluded"
    """The ``clock`` field of a run summary: what ``train_time_s``, throughput and time to target count."""

    def __init__(self) -> None:
        self._elapsed = 0.0
        self._since: float | None = None

    @property
    def seconds(self) -> float:
        return self._elapsed + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def _start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def _stop(self) -> None:
        if self._since is not None:
            self._elapsed += time.perf_counter() - self._since
            self._since = None

    @contextlib.contextmanager
    def running(self) -> Iterator["TrainingClock"]:
        self._start()
        try:
            yield self
        finally:
            self._stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator["TrainingClock"]:
        was_running = self._since is not None
        self._stop()
        try:
            yield self
        finally:
            if was_running:
                self._start()


def epoch_evaluation_due(training, epoch: int) -> bool:
    """Whether the end of epoch ``epoch`` (0-based) is evaluated: every epoch's with
    ``training.eval_at_epoch_ends``, else only the last (the run's final evaluation)."""
    return training.eval_at_epoch_ends or epoch + 1 >= training.num_epochs


def eval_due(step: int, interval: int, *, epoch_end: bool) -> bool:
    """Whether to evaluate after optimizer step ``step``: every epoch end, and every ``interval`` steps (0: never)."""
    return epoch_end or (interval > 0 and step % interval == 0)


def samples_due(before: int, after: int, every: int) -> bool:
    """Whether ``training.eval_every_samples`` wants an evaluation once the samples applied went from ``before``
    to ``after``: a multiple of ``every`` was reached (0: never)."""
    return every > 0 and after // every > before // every


def report_target(target: TimeToTarget, accuracy: float, seconds: float, step: int) -> None:
    """Feed one evaluation to ``target``; log a line the first time the target accuracy is reached."""
    if target.observe(accuracy, seconds, step):
        logger.info(
            "target accuracy %.2f%% reached at step %d, %.2fs into training", target.target * 100, step, seconds
        )


def progress(total: int, description: str):
    """A tqdm bar on a terminal, silent otherwise (logs, CI, subprocesses)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, leave=False, disable=not sys.stderr.isatty(), dynamic_ncols=True)


class BaselineTrainer:
    """Single-process training of the configured model; :meth:`run` returns the run summary.

    Args:
        config: validated config; ``system.checkpoint_dir`` / ``system.log_dir`` are the outputs.
        resume: a checkpoint file or folder to continue from (falls back to the newest good one).
        summary_json: where to write the summary (default ``<log_dir>/summary.json``).
    """

    def __init__(self, config: Config, *, resume: str | Path | None = None, summary_json: str | Path | None = None):
        self.config = config
        self.device = resolve_device(config.training.device)
        self.checkpoint_dir = Path(config.system.checkpoint_dir)
        self.log_dir = Path(config.system.log_dir)
        self.summary_json = Path(summary_json) if summary_json else self.log_dir / "summary.json"
        self.train_set, self.test_set = load_splits(config)
        self.model = model_from_config(config).to(self.device)
        self.optimizer = optimizer_from_config(config, self.model.parameters())
        self.amp = MixedPrecision(config.training.amp, self.device)
        self.start_epoch, self.step = 0, 0
        self.resumed_from: Path | None = None
        if resume is not None:
            self._restore(resume)

    def _restore(self, target: str | Path) -> None:
        path, checkpoint = load_latest_good(target)
        check_model_matches(path, checkpoint, self.config.training.model_architecture)
        self.model.load_state_dict(checkpoint["model_state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        self.amp.load_state_dict(checkpoint.get("extra", {}).get("grad_scaler"))
        self.start_epoch, self.step = checkpoint["epoch"], checkpoint["step"]
        self.resumed_from = path

    def _checkpoint(self, path: Path, epoch: int) -> Path:
        extra = {"grad_scaler": self.amp.state_dict()} if self.amp.scaler is not None else None
        with tracing.span("checkpoint", epoch=epoch, step=self.step):
            checkpoint = checkpoint_of_run(
                self.config, self.model, self.optimizer, epoch=epoch, step=self.step, extra=extra
            )
            return save_checkpoint(path, checkpoint)

    def _evaluate(
        self,
        log: MetricsLogger,
        epoch: int,
        target: TimeToTarget,
        clock: TrainingClock,
        extra: dict[str, float] | None = None,
    ) -> tuple[float, float]:
        t = self.config.training
        with clock.paused(), tracing.span("evaluate", step=self.step):
            loss, accuracy = evaluate(self.model, self.test_set, batch_size=t.eval_batch_size, device=self.device)
            log.scalars("eval", self.step, {"test_loss": loss, "test_accuracy": accuracy, **(extra or {})}, epoch=epoch)
            report_target(target, accuracy, clock.seconds, self.step)
        return loss, accuracy

    def run(self) -> dict[str, Any]:
        t = self.config.training
        started = time.perf_counter()
        clock, target = TrainingClock(), TimeToTarget(t.target_accuracy)
        samples = 0
        final_loss, final_accuracy = evaluate(
            self.model, self.test_set, batch_size=t.eval_batch_size, device=self.device
        )
        system = self.config.system
        with (
            MetricsLogger(
                self.log_dir,
                tensorboard="tensorboard" in self.config.metrics.trackers,
                sinks=open_trackers(self.config, self.log_dir),
            ) as log,
            tracing.trace_to(self.log_dir / tracing.TRACE_FILE, "baseline", enabled=system.trace),
        ):
            log.event(
                "run_start",
                architecture="baseline",
                config=self.config.to_dict(),
                resumed_from=str(self.resumed_from) if self.resumed_from else None,
            )
            self.model.train()
            for epoch in range(self.start_epoch, t.num_epochs):
                epoch_loss, epoch_correct, epoch_samples = self._train_epoch(log, epoch, target, clock, samples)
                samples += epoch_samples
                final_loss, final_accuracy = self._end_epoch(
                    log, epoch, target, clock, epoch_loss / max(epoch_samples, 1), epoch_correct / max(epoch_samples, 1)
                )
            checkpoint_path = self._checkpoint(
                final_checkpoint_path(self.checkpoint_dir, "baseline"), max(t.num_epochs, self.start_epoch)
            )
            summary = self._summary(
                final_loss, final_accuracy, time.perf_counter() - started, clock, target, samples, checkpoint_path
            )
            log.event("run_end", **summary)
            write_summary(self.summary_json, summary)
            log.finish(summary, artifacts=[self.summary_json, checkpoint_path])
        return summary

    def _train_epoch(
        self, log: MetricsLogger, epoch: int, target: TimeToTarget, clock: TrainingClock, samples_before: int
    ) -> tuple[float, int, int]:
        """One pass over the epoch's permutation (evaluating every ``eval_interval`` steps); returns its summed
        loss, correct predictions and samples."""
        t = self.config.training
        order = epoch_permutation(len(self.train_set), epoch, t.seed)
        num_steps = -(-len(order) // t.batch_size)
        epoch_loss, epoch_correct, epoch_samples = 0.0, 0, 0
        # Training time includes our own logging and progress bar, not evaluation or checkpoints.
        with (
            clock.running(),
            progress(num_steps, f"epoch {epoch + 1}/{t.num_epochs}") as bar,
            tracing.span("epoch", epoch=epoch + 1),
        ):
            for start in range(0, len(order), t.batch_size):
                loss, correct, batch, gradient_time, step_time = self._train_step(order[start : start + t.batch_size])
                epoch_loss += loss * batch
                epoch_correct += correct
                epoch_samples += batch
                last_step = start + t.batch_size >= len(order)
                if self.step % LOG_EVERY_STEPS == 0 or last_step:
                    log.scalars(
                        "train",
                        self.step,
                        {
                            "loss": loss,
                            "accuracy": correct / batch,
                            "throughput": batch / step_time,
                            "gradient_time_s": gradient_time,
                            "samples_processed": samples_before + epoch_samples,
                        },
                        epoch=epoch,
                    )
                if not last_step and eval_due(self.step, t.eval_interval, epoch_end=False):
                    self._evaluate(log, epoch, target, clock)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                bar.update()
        return epoch_loss, epoch_correct, epoch_samples

    def _train_step(self, indices) -> tuple[float, int, int, float, float]:
        """One optimizer step on the batch of ``indices``; returns its loss, correct predictions, size, and the
        seconds to its gradient and to the end of the step."""
        t = self.config.training
        step_started = time.perf_counter()
        images, labels = self.train_set.batch(indices)
        images, labels = images.to(self.device), labels.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with tracing.span("forward_backward", step=self.step + 1):
            loss, correct = forward_backward(self.model, images, labels, self.amp)
        gradient_time = time.perf_counter() - step_started
        with tracing.span("optimizer_step", step=self.step + 1):
            set_scheduled_learning_rate(self.optimizer, t, self.step)  # training.lr_schedule
            self.amp.step(self.optimizer)
        step_time = time.perf_counter() - step_started
        self.step += 1
        return loss, correct, len(labels), gradient_time, step_time

    def _end_epoch(
        self,
        log: MetricsLogger,
        epoch: int,
        target: TimeToTarget,
        clock: TrainingClock,
        train_loss: float,
        train_accuracy: float,
    ) -> tuple[float, float]:
        """The epoch's evaluation (with its training loss and accuracy) and its checkpoint, each when due; returns
        the test loss and accuracy (NaN when ``training.eval_at_epoch_ends`` skips this epoch's evaluation)."""
        t = self.config.training
        final_loss, final_accuracy = float("nan"), float("nan")
        if epoch_evaluation_due(t, epoch):
            final_loss, final_accuracy = self._evaluate(
                log, epoch + 1, target, clock, {"train_loss": train_loss, "train_accuracy": train_accuracy}
            )
            logger.info(
                "epoch %d/%d: test accuracy %.2f%%, test loss %.4f",
                epoch + 1,
                t.num_epochs,
                final_accuracy * 100,
                final_loss,
            )
        if (epoch + 1) % t.checkpoint_interval == 0 or epoch + 1 == t.num_epochs:
            written = self._checkpoint(numbered_path(self.checkpoint_dir, epoch + 1), epoch + 1)
            prune_checkpoints(self.checkpoint_dir, KEEP_CHECKPOINTS)
            log.event("checkpoint", path=str(written), epoch=epoch + 1, step=self.step)
        return final_loss, final_accuracy

    def _summary(
        self,
        final_loss: float,
        final_accuracy: float,
        total_time: float,
        clock: TrainingClock,
        target: TimeToTarget,
        samples: int,
        checkpoint_path: Path,
    ) -> dict[str, Any]:
        """The run summary (``summary.json`` and the ``run_end`` event)."""
        t = self.config.training
        train_time = clock.seconds
        return {
            "architecture": "baseline",
            "dataset": t.dataset,
            "num_workers": 1,
            "final_accuracy": final_accuracy,
            "final_loss": final_loss,
            "total_time_s": total_time,
            "train_time_s": train_time,
            "clock": "real",
            "training_clock": TrainingClock.DESCRIPTION,
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            **target.fields(),
            "samples_processed": samples,
            "bytes_sent": 0,
            "bytes_received": 0,
            "compression": "none",
            "checkpoint_path": str(checkpoint_path),
            "epochs": t.num_epochs,
            "steps": self.step,
            **self.amp.summary(),
        }
