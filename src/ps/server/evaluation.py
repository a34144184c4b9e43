"""The parameter server's evaluations: when one is due, running it (on the injected executor), recording it.

Evaluations run every ``training.eval_interval`` versions, every ``training.eval_every_samples``
samples, at epoch ends (unless ``training.eval_at_epoch_ends`` is off) and at the end of the run, on a
snapshot of the parameters taken under the lock; a real server runs them on a background thread, a
simulation inline. Each one is an ``eval`` event, may reach the target accuracy, and is where the
adaptive-compression controller decides.
"""

from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable

import torch
from torch import nn

from src.config import Config
from src.metrics import MetricsLogger
from src.ps.server.control import ServerControl
from src.ps.server.totals import RunTotals
from src.telemetry import tracing
from src.trainer import evaluate, samples_due

logger = logging.getLogger(__name__)


class InlineExecutor(Executor):
    """Runs each submitted task at once, in the caller (a simulation's evaluations: no background thread)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  (the future carries it, as a thread pool's would)
            future.set_exception(exc)
        return future


class ServerEvaluations:
    """Evaluates the served model on ``test_set`` (``None``: never) and records the results.

    Args:
        lock: the core's lock (a controller's decision is taken under it).
        background: runs evaluations (default: inline).
        on_failure: called with the error of an evaluation that raised (it ends the run).
    """

    def __init__(
        self,
        config: Config,
        test_set: Any,
        *,
        log: MetricsLogger,
        control: ServerControl,
        totals: RunTotals,
        lock: threading.Condition,
        background: Executor | None,
        on_failure: Callable[[BaseException], None],
    ):
        self.training = config.training
        self.test_set = test_set
        self.log = log
        self.control = control
        self.totals = totals
        self.lock = lock
        self.background = background or InlineExecutor()
        self._on_failure = on_failure
        self._eval_model: nn.Module | None = None

    def install(self, model: nn.Module) -> None:
        """The served model: evaluations load snapshots into a copy of it."""
        if self.test_set is not None:
            self._eval_model = copy.deepcopy(model)

    def due(self, version: int, epochs_done: list[int], samples_before: int, samples: int) -> bool:
        """Whether the update that made ``version`` (finishing ``epochs_done``, taking the samples applied
        from ``samples_before`` to ``samples``) is followed by an evaluation."""
        t = self.training
        if self.test_set is None:
            return False
        # the final evaluation covers the last epoch; training.eval_at_epoch_ends=False leaves only it
        evaluate_now = t.eval_at_epoch_ends and bool(epochs_done) and epochs_done[-1] + 1 < t.num_epochs
        if t.eval_interval and version % t.eval_interval == 0:
            evaluate_now = True
        if samples_due(samples_before, samples, t.eval_every_samples):  # the same sample counts in sync and async
            evaluate_now = True
        return evaluate_now

    def submit(self, epoch: int, version: int, snapshot: dict[str, torch.Tensor], elapsed: float, samples: int) -> None:
        """Evaluate ``snapshot`` (the parameters at ``version``) on the executor."""
        future = self.background.submit(self._evaluate_snapshot, epoch, version, snapshot, elapsed, samples)
        future.add_done_callback(self._done)

    def record(self, epoch: int, version: int, model: nn.Module, elapsed: float, samples: int) -> tuple[float, float]:
        """Evaluate ``model`` now: the ``eval`` event, the controller's decision, the target; (loss, accuracy)."""
        t = self.training
        with tracing.span("evaluate", version=version):
            loss, accuracy = evaluate(model, self.test_set, batch_size=t.eval_batch_size)
        event = self.log.scalars(
            "eval",
            version,
            {"test_loss": loss, "test_accuracy": accuracy},
            epoch=epoch,
            elapsed_s=elapsed,
            samples=samples,
        )
        if self.control.controller is not None:
            with self.lock:
                self.control.decide(event, self.log)
        if self.totals.target.observe(accuracy, elapsed, version):
            self.log.event("target_reached", version=version, elapsed_s=elapsed, accuracy=accuracy)
        logger.info(
            "epoch %d/%d: test accuracy %.2f%%, test loss %.4f (server version %d)",
            epoch,
            t.num_epochs,
            accuracy * 100,
            loss,
            version,
        )
        return loss, accuracy

    def final(self, version: int, model: nn.Module, elapsed: float, samples: int) -> tuple[float, float]:
        """The run's final evaluation, recorded as the last epoch's: (loss, accuracy), NaN without a test set."""
        if self.test_set is None:
            return float("nan"), float("nan")
        return self.record(self.training.num_epochs, version, model, elapsed, samples)

    def drain(self) -> None:
        """Wait for a pending evaluation to finish."""
        self.background.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for background work and stop the executor."""
        self.background.shutdown(wait=True)

    def _evaluate_snapshot(
        self, epoch: int, version: int, state: dict[str, torch.Tensor], elapsed: float, samples: int
    ) -> None:
        self._eval_model.load_state_dict(state)
        self.record(epoch, version, self._eval_model, elapsed, samples)

    def _done(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._on_failure(error)
