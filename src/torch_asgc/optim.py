"""DistributedOptimizer: a user's optimizer whose step() goes through the parameter server.

The server holds the authoritative optimizer (its config's ``training.optimizer``, learning rate, momentum, weight
decay) and applies the workers' gradients, so ``step()`` does not step the wrapped optimizer. It takes each
parameter's gradient of the :class:`~torch_asgc.model.DistributedModel` (zero for one that got none; unscaled first
under AMP), and hands it to the worker's step machine (:class:`src.ps.worker.machine.StepMachine`, the one our own
workers carry): error feedback and compression (:class:`src.ps.worker.codec.PushCodec`), the push with the Worker
Version and the step's sample count, and the reply settled (residuals committed, or rolled back when the staleness
policy rejects the push or its reply was lost with a session) before the parameters it carries are loaded.

docs/library.md says what a user's loop sees, and this module does it:

* **Schedules reach the server**: once a torch LR scheduler drives the wrapped optimizer (the ``initial_lr`` it
  leaves on the groups), each push carries ``param_groups[0]["lr"]`` (``send_learning_rate``: ``True`` always,
  ``False`` never); the other hyperparameters are the server's (a warning names a mismatch).
* **AMP**: ``scaler.step(optimizer)`` calls ``step()`` with ``grad_scale`` and ``found_inf``; a step with inf/NaN
  gradients is skipped and not pushed (sync: a gradient-free skip lets the barrier go on).
* **Streaming** (a server with ``system.streaming``): the first gradient of a backward opens a streamed push (one per
  shard), each gradient goes as autograd produces it, and ``step()`` closes it and waits for the reply's head only;
  the reply's tensors go on arriving for the next forward (:mod:`src.ps.worker.streaming`). A skipped step or a
  ``zero_grad()`` before ``step()`` gives the push up (the residuals and the rounding generator go back); gradient
  accumulation turns streaming off for the run; a GradScaler is refused.

``state_dict()`` holds the wrapped optimizer's state, the error-feedback residuals and the step counts.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

from src.compressors.error_feedback import ErrorFeedback
from src.config import SetupError
from src.ps.worker import PushCodec, PushStreams, Rejoined
from src.ps.worker.codec import all_finite, named_gradients, resolve_compression
from src.training.lr_schedule import is_constant

from .client import WorkerClient
from .wrapped import WrappedOptimizer, differences


class DistributedOptimizer(WrappedOptimizer):
    """Wrap ``optimizer`` so that ``step()`` pushes through ``client`` (see the module docstring).

    Args:
        optimizer: the user's optimizer over (some of) the :class:`~torch_asgc.model.DistributedModel`'s parameters.
        client: the connected client whose model is that DistributedModel.
        compression: ``None`` (the server's ``system.compression_*`` settings), ``"none"``, a
            :class:`~src.compression.Compressor` (e.g. ``build_compressor("topk", ratio=0.01)``) or a
            :class:`~src.compressors.policy.CompressionPolicy` (warm-up steps, small-tensor skipping).
        error_feedback: keep what compression leaves out and add it to the next gradient.
        seed: seed of the stochastic rounding of quantization (default ``training.seed`` + worker id).
        send_learning_rate: push the wrapped optimizer's learning rate with each step, for the server to
            apply: ``None`` (default) once a torch LR scheduler drives it, ``True`` always, ``False`` never.

    Raises:
        SetupError: no DistributedModel on ``client`` yet, the optimizer holds parameters it does not have, or
            (a server that streams) the model already has a DistributedOptimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        client: WorkerClient,
        *,
        compression: Any = None,
        error_feedback: bool = True,
        seed: int | None = None,
        send_learning_rate: bool | None = None,
    ):
        model = client.model
        if model is None:
            raise SetupError("DistributedOptimizer: wrap the model first (DistributedModel(module, client))")
        known = {id(p) for _, p in model.trainable}
        for group in optimizer.param_groups:
            if any(id(p) not in known for p in group["params"]):
                raise SetupError(
                    "DistributedOptimizer: the optimizer holds parameters that are not trainable "
                    "parameters of the DistributedModel"
                )
        super().__init__(optimizer)
        self.client = client
        system, training = client.config.system, client.config.training
        self.machine = client.machine
        self.machine.codec = PushCodec.of_worker(
            system, training.seed if seed is None else seed, client.worker_id, model.parameter_names, model.placement,
            compression=compression, error_feedback=error_feedback,
        )  # fmt: skip
        self.steps = 0
        self.skipped_steps = 0
        self.send_learning_rate = send_learning_rate
        self._warned_samples = False
        self._warned_schedule = False
        self.streaming = bool(system.streaming)
        """Whether pushes stream (the server's ``system.streaming``; off for good after gradient accumulation)."""
        self._open: PushStreams | None = None  # the streamed push opened by the current backward, not yet stepped
        self._generation = 0  # streamed replies so far
        self._waited_s = 0.0  # the forwards' waits for reply tensors, as counted at the last step
        if self.streaming:
            if model.streamed is not None:
                raise SetupError("DistributedOptimizer: streaming takes one DistributedOptimizer per DistributedModel")
            model.stream_pushes(self._open_push)
        differing = differences(optimizer, training)
        if differing:
            warnings.warn(
                "DistributedOptimizer: the server applies its own optimizer "
                f"({training.optimizer}, lr {training.learning_rate}); the wrapped optimizer differs: "
                + "; ".join(differing)
                + " (a learning-rate scheduler on it sends its rates to the server)",
                stacklevel=2,
            )

    # ------------------------------------------------------------------------- the push's compression state

    @property
    def codec(self) -> PushCodec:
        return self.machine.codec

    @property
    def feedback(self) -> ErrorFeedback | None:
        """The error-feedback residuals (``None``: no error feedback)."""
        return self.codec.feedback

    @feedback.setter
    def feedback(self, value: ErrorFeedback | None) -> None:
        self.codec.feedback = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's; a streamed push opened by a backward since the last step is given up first
        (those gradients are being dropped: the next backward's go)."""
        push, self._open = self._open, None
        if push is not None:
            self._abandon(push, RuntimeError("zero_grad() before step(): the push's gradients were dropped"))
        self.wrapped.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the error-feedback residuals and the step counts."""
        return {
            "optimizer": self.wrapped.state_dict(),
            "error_feedback": self.codec.residual_state(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back a :meth:`state_dict` (or a plain state dict of the wrapped optimizer)."""
        if "error_feedback" not in state_dict:
            self.wrapped.load_state_dict(state_dict)
            return
        self.wrapped.load_state_dict(state_dict["optimizer"])
        self.codec.load_residuals(state_dict["error_feedback"])
        self.steps = int(state_dict.get("steps", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    # ------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, num_samples: int | None = None) -> Any:
        """Push this step's gradient and load the parameters the server replies with.

        Args:
            closure: recomputes the loss (run with gradients on); its result is returned.
            num_samples: samples the gradient covers (default: counted by the DistributedModel's forwards).

        Raises:
            IncarnationRevoked: the server declared this worker failed (the process should stop).
            CallError: the server refused the push (the message names the problem).
        """
        loss = None
        started = time.perf_counter()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        model = self.client.model
        push, self._open = self._open, None  # system.streaming: the push this step's backward fed
        counted = model.take_samples()
        samples = counted if num_samples is None else int(num_samples)
        gradients = [p.grad for _, p in model.trainable]
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        grad_scale = getattr(self, "grad_scale", None)  # None: already unscaled (scaler.unscale_), or no scaler
        if push is not None:
            push = self._streamable(push, found_inf)
        if bool(found_inf > 0) if found_inf is not None else not all_finite(gradients):
            if push is not None:  # its parts are dropped; the skip goes as it does unstreamed
                self._abandon(push, RuntimeError("a step skipped for non-finite gradients"))
            self.skipped_steps += 1
            model.wait_for_reply()
            self.client.run(self.machine.skip())  # sync: the barrier goes on without us
            model.loaded()
            return loss
        if samples <= 0:
            self._warn_no_samples()
            samples = 1
        computed = time.perf_counter()
        if push is None:
            model.wait_for_reply()  # a streamed reply still arriving is in before this push's reply is loaded
            payloads = self.machine.encode(named_gradients(model.trainable, gradients, grad_scale))
        compressed = time.perf_counter()
        request = self.machine.request(
            samples=samples,
            loss=float(loss) if isinstance(loss, (torch.Tensor, float)) else None,
            gradient_time_s=computed - started,
            compression_time_s=0.0 if push is not None else compressed - computed,
            learning_rate=self._learning_rate_to_send(),
        )
        if push is not None:
            outcome = self._step_streamed(push, request, started, computed)
        else:
            times = (computed - started, compressed - computed, compressed)
            outcome = self.client.connections.push_step(self.machine, request, payloads, model.buffer_views(), times)
        if isinstance(outcome, Rejoined):  # the push was lost with a session: the machine pulled the parameters
            model.loaded()
        self._mark_wrapped_stepped()
        self.steps += 1
        return loss

    # ------------------------------------------------------------------------- a streamed step (system.streaming)

    def _open_push(self) -> PushStreams | None:
        """The first gradient of a backward is ready and no push is open (autograd's thread): open a streamed push
        (one per shard) whose parts are the machine's payloads, its reply's tensors going into the model as they
        arrive."""
        if not self.streaming:
            return None
        model, machine = self.client.model, self.machine
        self._generation += 1
        params = [p for _, p in model.trainable]

        def gradient_of(index: int) -> torch.Tensor:
            grad = params[index].grad
            return grad if grad is not None else torch.zeros_like(params[index], dtype=torch.float32)

        model.streamed.repeated = 0
        self._open = self.client.connections.open_push(
            machine, model.streamed, gradient_of, model.parameter_names, generation=self._generation,
            pieced=self.client.config.system.pipelined_replies,
        )  # fmt: skip
        return self._open

    def _streamable(self, push: PushStreams, found_inf: Any) -> PushStreams | None:
        """``push`` if it holds this step's gradient as the unstreamed push would; ``None`` (given up) after a
        second backward (gradient accumulation: streaming stops for the run).

        Raises:
            SetupError: a GradScaler drives this optimizer.
        """
        if found_inf is not None:
            self._abandon(push, RuntimeError("a GradScaler step"))
            raise SetupError(
                "DistributedOptimizer: the server streams pushes (system.streaming), which sends the gradients as "
                "backward produces them, still scaled: not with a GradScaler (use bfloat16 autocast, or a server "
                "without --streaming)"
            )
        if not self.client.model.streamed.repeated:
            return push
        self._abandon(push, RuntimeError("gradient accumulation"))
        self.streaming = False
        warnings.warn(
            "DistributedOptimizer: a second backward before step() (gradient accumulation): the server streams "
            "pushes, but an accumulated gradient is whole only at step(), so this and every later push goes "
            "unstreamed",
            stacklevel=3,
        )
        return None

    def _abandon(self, push: PushStreams, error: BaseException) -> None:
        """Give up a streamed push before its message (:meth:`~src.ps.worker.connections.Connections.give_up`: as if
        nothing had been encoded)."""
        self.client.connections.give_up(push, self.client.model.streamed, self.codec, error)

    def _step_streamed(self, push: PushStreams, request: Any, started: float, computed: float) -> Any:
        """Close the streamed push with its small fields (each shard's hold), wait for the reply's head (a sharded
        server's: the commit's reply and the pulls) and settle it (:meth:`Connections.close_push
        <src.ps.worker.connections.Connections.close_push>`); one server's reply tensors go on arriving for the next
        forward. The outcome."""
        model = self.client.model
        streamed = model.streamed
        streamed.end_backward()  # the parameters no gradient reached go now, as zeros
        if model.placement is None:
            model.reply_call = self.client.connections.stream_calls[0]
        # exposed: the wait for the head, and the forwards' waits for tensors since the last step
        waited, self._waited_s = streamed.waited_s - self._waited_s, streamed.waited_s
        times = (computed - started, computed, waited)
        buffers = model.buffer_views()
        return self.client.connections.close_push(self.machine, streamed, push, request, buffers, times)[0]

    def _warn_no_samples(self) -> None:
        """Once per optimizer: no forward counted a batch since the last step, so the push is counted as 1 sample."""
        if not self._warned_samples:
            warnings.warn(
                "DistributedOptimizer: no training forward counted a batch since the last step; "
                "pass step(num_samples=...) (counting this push as 1 sample)",
                stacklevel=3,
            )
            self._warned_samples = True

    def _learning_rate_to_send(self) -> float | None:
        """The wrapped optimizer's current rate, when it goes with the push (``send_learning_rate``); ``None``: not."""
        group = self.wrapped.param_groups[0]
        send = self.send_learning_rate
        if send is None:
            send = "initial_lr" in group  # torch's LRScheduler records it on the groups it drives
        if not send:
            return None
        schedule = self.client.config.training.lr_schedule
        if not self._warned_schedule and not is_constant(schedule):
            warnings.warn(
                f"DistributedOptimizer: the server has a training.lr_schedule ({schedule.kind}); this "
                "worker sends its own scheduler's learning rates, which the server applies instead",
                stacklevel=3,
            )
            self._warned_schedule = True
        return float(group["lr"])


__all__ = ["DistributedOptimizer", "resolve_compression"]
