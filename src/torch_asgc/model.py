"""DistributedModel: keeps a user's nn.Module in step with the parameter server's versions.

The forward pass is the module's own; the wrapper only

* at construction, gives a server that has no model yet this module's layout and initial values
  (the first worker to do so wins; the others get its values), then pulls the server's parameters
  and buffers into the module (sync: once every worker is there, like DDP's start);
* holds the parameters of every reply in the module (the client's step machine loads them,
  :class:`~src.ps.worker.machine.StepMachine`), and their version (the *Worker Version*, sent with each
  push so the server knows the gradient's staleness);
* counts the samples of the training forwards since the last step (the first dimension of the first
  tensor argument, in training mode with gradients on), so each push says how many samples its
  gradient covers; ``optimizer.step(num_samples=n)`` overrides it.

With a server that streams (``system.streaming``, :class:`~torch_asgc.optim.DistributedOptimizer` turns it on)
a push's reply is still arriving when ``step()`` returns: each module's forward waits until its own tensors are in
(:class:`src.ps.worker.streaming.StreamedModel`'s pre-hooks), so the next forward's first layers run while the last
ones arrive. :meth:`DistributedModel.state_dict`, :meth:`~DistributedModel.load_state_dict` and
:meth:`~DistributedModel.sync` first wait for the whole reply (:meth:`DistributedModel.wait_for_reply`); the plain
module's own ``state_dict()`` does not. A reply that breaks off after its head (its push was applied, some
tensors never came) makes this wrapper's forward pull the parameters and compute the forward again.

What the server holds are the module's trainable parameters (in ``named_parameters()`` order) and
floating-point buffers (batch-norm statistics); both travel as float32. ``state_dict()`` and
``load_state_dict()`` are the module's own (no ``module.`` prefix), so checkpoints load into the
plain module too.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from typing import Any, Callable

import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.config import SetupError
from src.ps.shards.shard_zero import Sharding
from src.ps.state.model_sources import layout_mismatch
from src.ps.worker import PushStreams, StreamedModel, served_tensors
from src.transport.errors import CallError
from src.transport.stream import ReplyBroken
from src.transport.wire import tensor_view

from .client import WorkerClient

logger = logging.getLogger(__name__)


def _batch_size(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


class DistributedModel(nn.Module):
    """Wrap ``module`` for training on the parameter server that ``client`` is connected to.

    Args:
        module: the user's model (parameters on any device; they travel as float32).
        client: a connected :class:`~torch_asgc.client.WorkerClient` (one model per client).
        count_samples: count batch sizes from the module's forward calls (integrations that know
            the batch size themselves turn it off and call :meth:`add_samples`).

    Raises:
        SetupError: the module does not match the model the server already serves, or the client
            already has a model.
    """

    def __init__(self, module: nn.Module, client: WorkerClient, *, count_samples: bool = True):
        super().__init__()
        if client.model is not None:
            raise SetupError("this client already has a DistributedModel: connect() once per model")
        self.module = module
        self.client = client
        self.trainable, self.float_buffers = served_tensors(module)
        self.placement = (  # a sharded server's: where each parameter's slices live (every process computes it)
            Sharding.of_run(module, client.config.system, client.token).placement if client.sharded else None
        )
        self.machine = client.machine
        self.machine.attach(
            [n for n, _ in self.trainable],
            [p for _, p in self.trainable],
            [n for n, _ in self.float_buffers],
            [b for _, b in self.float_buffers],
            self.placement,
        )
        self._samples = 0
        self.streamed: StreamedModel | None = None
        """``system.streaming``: the hooks that hand gradients to a streamed push and wait for a reply's tensors."""
        self.reply_call: Future | None = None
        """``system.streaming``: the call of the newest closed streamed push (its reply may still be arriving)."""
        self._hook = module.register_forward_pre_hook(self._count, with_kwargs=True) if count_samples else None
        client.model = self
        try:
            if client.registration.model_wanted:
                try:
                    self.offer()
                except CallError as exc:  # another worker's model came first and differs
                    if exc.code != "FAILED_PRECONDITION":
                        raise
                    raise SetupError(exc.message) from None
            else:
                self._check_layout(client.registration)
            self.sync()
        except BaseException:
            client.model = None
            self.remove_hooks()
            raise

    @property
    def version(self) -> int:
        """The version of the parameters the module holds (a sharded server's: shard 0's)."""
        return self.machine.version

    @property
    def shard_versions(self) -> list[int]:
        """A sharded server: the version of each shard's slices the module holds."""
        return self.machine.shard_versions

    # ------------------------------------------------------------------------- the user's side

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.streamed is None:
            return self.module(*args, **kwargs)
        samples = self._samples
        try:
            return self.module(*args, **kwargs)
        except ReplyBroken as broken:  # the push was applied, but its reply's tensors stopped coming
            logger.warning("worker %s: %s; pulling the parameters", self.client.worker_id, broken)
            self._samples = samples  # this forward's samples are counted once, by the forward again
            self.sync()
            return self.module(*args, **kwargs)

    def sync(self) -> int:
        """Pull the server's newest parameters and buffers into the module; returns their version.

        In sync mode this waits for this worker's turn in the barrier (right away between steps).
        """
        self.wait_for_reply()
        reply = self.client.run(self.machine.pull_everything())
        if reply.message.work.batches:
            raise SetupError(
                "this server hands out its own batches (run_parameter_server_training.py); for your own "
                "loop and data start `python -m torch_asgc.server`"
            )
        self.loaded()
        return self.version

    def loaded(self) -> None:
        """The machine loaded every tensor of a reply into the module: the next forward waits for none."""
        if self.streamed is not None:
            self.streamed.loaded()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait_for_reply()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self.wait_for_reply()
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def wait_for_reply(self) -> None:
        """``system.streaming``: wait until the last push's reply is all in (or broke off); at once otherwise."""
        if self.reply_call is not None:
            wait([self.reply_call])

    def stream_pushes(self, open_push: Callable[[], PushStreams | None]) -> StreamedModel:
        """Put the streaming hooks on the module (:class:`~src.ps.worker.streaming.StreamedModel`): the first gradient
        of a backward opens a push with ``open_push``, each gradient goes to it as it is ready, and each module's
        forward waits for its own tensors of the reply being read."""
        self.streamed = StreamedModel(
            self.module,
            [p for _, p in self.trainable],
            [b for _, b in self.float_buffers],
            open_push=open_push,
        )
        return self.streamed

    # ------------------------------------------------------------------------- used by the optimizer and the client

    @property
    def parameter_names(self) -> list[str]:
        return [n for n, _ in self.trainable]

    def buffer_views(self) -> list[memoryview]:
        """The floating-point buffers as float32 bytes, for a push."""
        return [tensor_view(b) for _, b in self.float_buffers]

    def add_samples(self, count: int) -> None:
        """Count ``count`` more samples into the next push."""
        self._samples += int(count)

    def take_samples(self) -> int:
        """The samples counted since the last push (and start counting afresh)."""
        count, self._samples = self._samples, 0
        return count

    def offer(self) -> bool:
        """Give a server without a model this module's layout and values; whether they became version 0."""
        return self.client.run(self.machine.offer())

    def remove_hooks(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.streamed is not None:
            self.streamed.close()

    # ------------------------------------------------------------------------- internals

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self._samples += _batch_size(args, kwargs)

    def _check_layout(self, registration: pb.RegisterReply) -> None:
        mine = (
            [(n, tuple(p.shape)) for n, p in self.trainable]
            if self.placement is None
            else [(piece.key, (piece.numel,)) for piece in self.placement.on_shard(0)]  # shard 0 serves its slices
        )
        mismatch = layout_mismatch(
            (mine, [(n, tuple(b.shape)) for n, b in self.float_buffers]),
            ([s.name for s in registration.parameter_specs], [tuple(s.shape) for s in registration.parameter_specs]),
            ([s.name for s in registration.buffer_specs], [tuple(s.shape) for s in registration.buffer_specs]),
        )
        if mismatch:
            raise SetupError(f"worker {self.client.worker_id}: the model does not match the server's: {mismatch}")
