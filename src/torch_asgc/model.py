"""DistributedModel: keeps a user's nn.Module in step with the parameter server's versions.

The forward pass is the module's own; the wrapper only

* at construction, gives a server that has no model yet this module's layout and initial values
  (the first worker to do so wins; the others get its values), then pulls the server's parameters
  and buffers into the module (sync: once every worker is there, like DDP's start);
* loads the parameters of every push reply (:class:`~torch_asgc.optim.DistributedOptimizer` calls
  :meth:`DistributedModel.load`), and tracks their version (the *Worker Version*, sent with each
  push so the server knows the gradient's staleness);
* counts the samples of the training forwards since the last step (the first dimension of the first
  tensor argument, in training mode with gradients on), so each push says how many samples its
  gradient covers; ``optimizer.step(num_samples=n)`` overrides it.

What the server holds are the module's trainable parameters (in ``named_parameters()`` order) and
floating-point buffers (batch-norm statistics); both travel as float32. ``state_dict()`` and
``load_state_dict()`` are the module's own (no ``module.`` prefix), so checkpoints load into the
plain module too.
"""

from __future__ import annotations

from typing import Any

import grpc
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.config import SetupError
from src.ps import shard_step
from src.ps.served_model import layout_mismatch
from src.ps.shard_push import load_shard_reply
from src.ps.sharding import Sharding
from src.ps.worker_protocol import load_reply, served_tensors
from src.transport.grpc import Received, tensor_view

from .client import WorkerClient


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
        self.version = 0
        self.shard_versions = [0] * (self.placement.num_shards if self.placement is not None else 1)
        """A sharded server: the version of each shard's slices loaded (each push to a shard is based on its own)."""
        self._samples = 0
        self._hook = module.register_forward_pre_hook(self._count, with_kwargs=True) if count_samples else None
        client.model = self
        try:
            if client.registration.model_wanted:
                try:
                    self.offer()
                except grpc.RpcError as exc:  # another worker's model came first and differs
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    raise SetupError(exc.details()) from None
            else:
                self._check_layout(client.registration)
            self.sync()
        except BaseException:
            client.model = None
            self.remove_hooks()
            raise

    # ------------------------------------------------------------------------- the user's side

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def sync(self) -> int:
        """Pull the server's newest parameters and buffers into the module; returns their version.

        In sync mode this waits for this worker's turn in the barrier (right away between steps).
        """
        while True:
            reply = self.client.pull()
            if reply.message.work.batches:
                raise SetupError(
                    "this server hands out its own batches (run_parameter_server_training.py); for your own "
                    "loop and data start `python -m torch_asgc.server`"
                )
            if self.placement is None:
                return self.load(reply)
            self.load_shards([reply, *self.client.pull_shards(reply.message.certificate, first=1)])
            if not self.shards_apart(self.version):  # else a shard is starting again: pull again
                return self.version

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # ------------------------------------------------------------------------- used by the optimizer and the client

    @property
    def parameter_names(self) -> list[str]:
        return [n for n, _ in self.trainable]

    def load(self, reply: Received) -> int:
        """Put a pull or push reply's parameters and buffers into the module; returns (and keeps) their version."""
        self.version = load_reply([p for _, p in self.trainable], [b for _, b in self.float_buffers], reply)
        return self.version

    def load_shards(self, replies: list[Received]) -> list[int]:
        """A sharded server's replies, one per shard in order (shard 0's carries the buffers), into the module;
        their versions (shard 0's is kept)."""
        params = {name: param for name, param in self.trainable}
        buffers = [b for _, b in self.float_buffers]
        versions = [load_shard_reply(self.placement, k, params, buffers, reply) for k, reply in enumerate(replies)]
        self.version = versions[0]
        self.shard_versions = versions
        return versions

    def shards_apart(self, version: int) -> bool:
        """Whether the shards' slices loaded do not fit together after shard 0 answered at ``version``
        (:func:`src.ps.shard_step.shards_apart`)."""
        return shard_step.shards_apart(self.shard_versions, version, self.client.mode)

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
        request = pb.InitializeRequest(
            parameter_specs=[pb.TensorSpec(name=n, shape=list(p.shape)) for n, p in self.trainable],
            buffer_specs=[pb.TensorSpec(name=n, shape=list(b.shape)) for n, b in self.float_buffers],
        )
        return self.client.initialize(
            request, [tensor_view(p) for _, p in self.trainable], [tensor_view(b) for _, b in self.float_buffers]
        )

    def remove_hooks(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

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
