"""The timing of a streamed parameter-server step in virtual time (``system.streaming``): compute spread over the
layers, gradients ready in backward order, parts queued on the worker's link, the next forward waiting per layer.

A streamed worker (:mod:`src.ps.worker.streaming`) sends each gradient as backward produces it and takes the reply's
tensors as they arrive, while its next forward waits for a layer only if it must. This module holds the pure pieces
a virtual worker (:mod:`src.virtual.worker`) composes into such a step on the event loop
(:mod:`src.emulation.event_loop`):

* :func:`split_step`: a step's compute seconds spread over the layers by weight, forward and backward
  (:mod:`src.virtual.layers` gives the weights);
* :func:`ready_offsets`: when each gradient is ready, from the start of backward: backward runs the layers in
  reverse, and a layer's gradients are whole when its segment ends;
* :func:`encode_times`: when each part is encoded (compensated and compressed) on the push's one thread, in the
  order the gradients became ready; :func:`shard_encode_times`: the same with a thread per server shard, and the
  seconds each shard's parts took (its hold's compression time);
* :class:`FifoLink`: messages on one link, one after another in the order they were put (a streamed push's parts,
  then its message; a reply's pieces);
* :class:`ForwardPass`: a forward over the layers, layer i starting at max(end of layer i-1, arrival of the
  tensors it needs); the seconds it waited are exposed communication.

So a step's exposed communication is what the real streamed worker reports as its ``communication_time_s``: from
the end of backward to the reply's head, plus the next forward's waits.

Pure: no torch, no I/O, no threads.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable, Sequence

from src.emulation.event_loop import EventLoop


def split_step(step_s: float, weights: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``step_s`` seconds of forward and backward spread over the layers by ``weights`` (per layer, in forward
    order, its forward and backward weight): each layer's ``(forward seconds, backward seconds)``, summing to
    ``step_s``. Weights that sum to 0 put the whole step in the last layer's forward.

    Raises:
        ValueError: a weight is negative, or there is no layer.
    """
    if not weights:
        raise ValueError("no layer to spread a step over")
    if any(w < 0 for pair in weights for w in pair):
        raise ValueError(f"layer weights must be >= 0, got {list(weights)}")
    total = sum(f + b for f, b in weights)
    if total <= 0:
        return [(0.0, 0.0)] * (len(weights) - 1) + [(step_s, 0.0)]
    return [(step_s * f / total, step_s * b / total) for f, b in weights]


def ready_offsets(backward_s: Sequence[float], layer_of: Sequence[int]) -> list[float]:
    """Seconds from the start of backward until each gradient is ready: backward runs the layers from the last to
    the first (``backward_s``: each layer's seconds, in forward order), and gradient g (``layer_of[g]``: its layer;
    -1: none, it is ready when backward ends) is whole when its layer's segment ends."""
    ends = [0.0] * len(backward_s)
    elapsed = 0.0
    for layer in reversed(range(len(backward_s))):
        elapsed += backward_s[layer]
        ends[layer] = elapsed
    return [elapsed if layer < 0 else ends[layer] for layer in layer_of]


def encode_times(ready_s: Sequence[float], encode_s: Sequence[float]) -> list[float]:
    """When each part is encoded on the push's one thread: part k (in the order handed over) starts when it is
    ready and the part before it is encoded, and takes ``encode_s[k]``."""
    done, free = [], float("-inf")
    for ready, seconds in zip(ready_s, encode_s):
        free = max(ready, free) + seconds
        done.append(free)
    return done


def shard_encode_times(
    ready_s: Sequence[float], encode_s: Sequence[float], shard_of: Sequence[int], shards: int
) -> tuple[list[float], list[float]]:
    """When each part is encoded, each shard's parts (``shard_of[k]``: part k's shard, one of ``shards``) on that
    shard's push's one thread (:func:`encode_times`, in the order handed over), and the seconds each shard's parts
    took to encode in all."""
    done, busy = [0.0] * len(ready_s), [0.0] * shards
    for shard in range(shards):
        mine = [k for k, of in enumerate(shard_of) if of == shard]
        busy[shard] = sum(encode_s[k] for k in mine)
        for k, at in zip(mine, encode_times([ready_s[k] for k in mine], [encode_s[k] for k in mine])):
            done[k] = at
    return done, busy


Start = Callable[[Callable[[], None]], None]
"""Starts one message on a link; calls its argument when the link is free again (the message's last bit out)."""


class FifoLink:
    """Messages on one link in the order they were put: each starts when the one before it has left the link.

    :meth:`put` takes what starts a message (a :data:`Start`): it is called at once when the link is idle, else when
    the messages put before it are through. Idle gaps (no message ready) cost nothing."""

    def __init__(self) -> None:
        self._waiting: deque[Start] = deque()
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    def put(self, start: Start) -> None:
        self._waiting.append(start)
        if not self._busy:
            self._next()

    def _next(self) -> None:
        if not self._waiting:
            self._busy = False
            return
        self._busy = True
        self._waiting.popleft()(self._next)


class ForwardPass:
    """A forward over the layers of a streamed worker, each layer waiting for the tensors it needs.

    Layer i starts at max(end of layer i-1, arrival of its tensors) and takes ``forward_s[i]``; ``needs[i]`` are its
    tensors' keys, and ``missing`` is the set of keys not arrived yet (the caller removes a key from it when the
    tensor arrives and then calls :meth:`arrived`). ``done(waited_s)`` when the last layer ends, ``waited_s`` the
    seconds the layers waited for their tensors (exposed communication); ``on_wait(start, end)`` for each wait.
    """

    def __init__(
        self,
        loop: EventLoop,
        forward_s: Sequence[float],
        needs: Sequence[frozenset[Hashable]],
        missing: set[Hashable],
        done: Callable[[float], None],
        on_wait: Callable[[float, float], None] | None = None,
    ):
        if len(forward_s) != len(needs):
            raise ValueError(f"{len(forward_s)} layer durations for {len(needs)} layers")
        self.loop = loop
        self.forward_s = list(forward_s)
        self.needs = list(needs)
        self.missing = missing
        self.done = done
        self.on_wait = on_wait
        self.waited_s = 0.0
        self.layer = 0
        self.blocked_since: float | None = None  # the layer waits for its tensors since then
        self.started = False
        self.finished = False

    def start(self) -> None:
        """The forward begins now, with layer 0."""
        if self.started:
            raise RuntimeError("the forward has started already")
        self.started = True
        self._layer()

    def arrived(self) -> None:
        """A tensor arrived (its key is out of ``missing``): the layer waiting for it goes on if it has all it needs."""
        if self.blocked_since is None or self.needs[self.layer] & self.missing:
            return
        self.waited_s += self.loop.now - self.blocked_since
        if self.on_wait is not None:
            self.on_wait(self.blocked_since, self.loop.now)
        self.blocked_since = None
        self.loop.after(self.forward_s[self.layer], self._ended)

    def _layer(self) -> None:
        if self.layer == len(self.forward_s):
            self.finished = True
            self.done(self.waited_s)
            return
        if self.needs[self.layer] & self.missing:
            self.blocked_since = self.loop.now
            return
        self.loop.after(self.forward_s[self.layer], self._ended)

    def _ended(self) -> None:
        self.layer += 1
        self._layer()
