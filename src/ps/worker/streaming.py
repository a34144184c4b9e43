"""A parameter-server worker that communicates while it computes (``system.streaming``): the hooks on its model.

:class:`StreamedModel` puts two kinds of hook on the worker's model and nothing else changes in how the step is
computed (:meth:`src.ps.worker.compute.WorkerCompute.compute`):

* **Backward hands each gradient over as it is ready.** A post-accumulate-grad hook on every parameter tells the
  push in progress (:class:`~src.transport.stream.PushStream`, :meth:`begin_push`) that gradient ``i`` is whole.
  The client's thread compensates, compresses and sends it while backward goes on with the layers below (the
  gradients come in reverse layer order, as autograd produces them). A parameter whose hook did not fire (no
  gradient this step) is handed over after backward (:meth:`end_backward`), as zeros, as an unstreamed push sends
  it.
* **The next forward waits for a layer only if it must.** The reply arrives in the background, buffers first,
  then the parameters in model order (forward order); :meth:`on_large` (the reply splitter's hook, on the
  client's thread) copies each tensor into the model as soon as it is whole. A forward pre-hook on every module
  with tensors of its own waits until those of the awaited reply are in (:meth:`expect`), and counts the wait:
  that is communication the step could not hide (:attr:`waited_s`).

Replies are numbered (``generation``): a tensor is in once the reply that carried it is at least the one the
forward expects, so nothing is ever cleared, and a late byte of an older reply cannot be taken for a newer one.
A reply that broke off after its head (:meth:`reply_broken`) makes the waiting forward raise
:class:`~src.transport.stream.ReplyBroken`; the worker then pulls the parameters and computes the step again.

A loop that has no step to open the push before backward (the library's
:class:`~torch_asgc.optim.DistributedOptimizer`) gives ``open_push``: the first gradient ready with no push in
progress opens one. A gradient ready again while its push is still open (a second backward before the push
closed: gradient accumulation) is not handed over twice; :attr:`StreamedModel.repeated` counts it, and such a
push does not hold the accumulated gradient (the library then sends it unstreamed).

The module's own tensors are what its pre-hook waits for: a parameter that a module's forward uses but another
module owns (a weight used functionally elsewhere) is not waited for there; such a model should not stream.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from src.ps.worker.loading import load_reply_tensor
from src.telemetry import tracing
from src.transport.stream import PushStream, ReplyBroken


class PushStreams:
    """A streamed push: one :class:`~src.transport.stream.PushStream` per shard (one server: one), each gradient
    handed to the streams of the shards holding its slices (``slices``: per tensor, ``(shard, position)`` of each
    part, :meth:`~src.ps.worker.codec.PushCodec.slices_of`). ``generation``: its reply's number (the module
    docstring); ``generator_state``: the rounding generator before its parts, restored if the push is given up
    (:meth:`~src.ps.worker.connections.Connections.give_up`)."""

    def __init__(
        self,
        streams: Sequence[PushStream],
        slices: Sequence[Sequence[tuple[int, int]]],
        *,
        generation: int = 0,
        generator_state: torch.Tensor | None = None,
    ):
        self.streams = list(streams)
        self.slices = slices
        self.generation = generation
        self.generator_state = generator_state

    def ready(self, index: int) -> None:
        for shard, position in self.slices[index]:
            self.streams[shard].ready(position)

    def encoded_keys(self, keys: Sequence[Sequence[Any]]) -> list[Any]:
        """The residual keys the parts encoded so far updated (``keys``: per shard, per position,
        :attr:`PushCodec.keys <src.ps.worker.codec.PushCodec.keys>`)."""
        return [keys[k][position] for k, stream in enumerate(self.streams) for position, _ in stream.encoded]


class StreamedModel:
    """The hooks of a streamed worker on ``model`` (see the module docstring).

    Args:
        model: the module the worker computes in.
        params: the parameters replies load, in the served order (the push's and the reply's).
        buffers: the float buffers replies load, in the served order.
        open_push: called (on autograd's thread) when a gradient is ready and no push is in progress: the push to
            hand it to (``None``: none); without it, only :meth:`begin_push` opens a push.
    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        *,
        open_push: Callable[[], PushStream | None] | None = None,
    ):
        self.params = list(params)
        self.buffers = list(buffers)
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        self._buffer_index = {id(b): i for i, b in enumerate(self.buffers)}
        self._arrived = {"parameters": [0] * len(self.params), "buffers": [0] * len(self.buffers)}
        self._condition = threading.Condition()
        self._expected = 0  # the reply the next forward needs (0: what the worker holds now, loaded whole)
        self._broken: dict[int, BaseException] = {}
        self._stream: PushStream | PushStreams | None = None
        self._pending: set[int] = set()
        self.waited_s = 0.0
        self.open_push = open_push
        self.repeated = 0  # gradients ready again while their push was open (a second backward: accumulation)
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda _p, index=i: self._gradient_ready(index))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        for module in model.modules():
            own = [
                ("parameters", self._param_index[id(p)])
                for p in module.parameters(recurse=False)
                if id(p) in self._param_index
            ] + [
                ("buffers", self._buffer_index[id(b)])
                for b in module.buffers(recurse=False)
                if id(b) in self._buffer_index
            ]
            if own:
                self._handles.append(module.register_forward_pre_hook(lambda _m, _args, own=own: self._wait(own)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------- the push

    def begin_push(self, stream: PushStream | PushStreams) -> None:
        """Backward is about to run: its gradients go to ``stream`` (or each shard's) as they are ready."""
        self._pending = set(range(len(self.params)))
        self._stream = stream

    def _gradient_ready(self, index: int) -> None:
        stream = self._stream  # autograd's thread: hand it over, nothing more
        if stream is None and self.open_push is not None:
            stream = self.open_push()
            if stream is not None:
                self.begin_push(stream)
        if stream is None:
            return
        if index in self._pending:
            self._pending.discard(index)
            stream.ready(index)
        else:
            self.repeated += 1

    def end_backward(self) -> None:
        """Backward is done: the gradients no hook handed over (none computed this step) go now."""
        stream, self._stream = self._stream, None
        if stream is not None:
            for index in sorted(self._pending):
                stream.ready(index)
        self._pending = set()

    # ------------------------------------------------------------------------- the reply

    def on_large(self, generation: int):
        """The reply splitter's ``on_large`` for reply ``generation``: each tensor into the model as it is whole."""

        def take(name: str, index: int, view) -> None:
            if name not in ("parameters", "buffers", "parameter_deltas"):
                return
            load_reply_tensor(name, index, (self.buffers if name == "buffers" else self.params)[index], view)
            name = "buffers" if name == "buffers" else "parameters"
            with self._condition:
                self._arrived[name][index] = generation
                self._condition.notify_all()

        return take

    def expect(self, generation: int) -> None:
        """The next forward needs reply ``generation``'s tensors (its head is in, its tensors arriving)."""
        with self._condition:
            self._expected = generation

    def loaded(self) -> None:
        """The worker loaded every tensor itself (a pull): the forward waits for nothing."""
        with self._condition:
            self._expected = 0

    def reply_broken(self, generation: int, error: BaseException) -> None:
        """Reply ``generation`` broke off after its head: a forward waiting for its tensors raises."""
        with self._condition:
            self._broken[generation] = error
            self._condition.notify_all()

    def _wait(self, own: list[tuple[str, int]]) -> None:
        with self._condition:
            expected = self._expected
            if all(self._arrived[name][index] >= expected for name, index in own):
                return
            started = time.perf_counter()
            while not all(self._arrived[name][index] >= expected for name, index in own):
                if expected in self._broken:
                    raise ReplyBroken(f"reply {expected} broke off: {self._broken[expected]}")
                self._condition.wait()
        ended = time.perf_counter()
        self.waited_s += ended - started
        tracing.record("parameter_wait", started, ended)
