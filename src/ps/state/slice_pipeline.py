"""Replies that leave before the barrier (``system.pipelined_replies``): a sync server steps each slice of a
parameter as soon as every worker's gradient of that slice is in, and sends it back while the rest of the push is
still on its way up; at the barrier it keeps only what its own step confirms.

Why: with streamed pushes (``system.streaming``) a worker's gradients travel during its backward, but in sync mode
the reply of a tensor can leave only once every worker's part of it is in, so the push and the reply of the same
big tensor still follow each other on a worker's link: the first linear layer of a small CNN (most of its bytes)
went up during backward and came down during the next forward, which then waited for it. P3 (MLSys'19) and BytePS
slice parameters and apply each slice as soon as its gradients are summed, so a slice's reply overlaps the next
slice's push (a link carries both directions at once). This is that, made safe for a server that owns the optimizer
and must survive a worker that fails mid-push:

* **Provisional slices.** The server knows each sync round's workers and the samples it handed each
  (:meth:`SlicePipeline.open_round`; where the workers' own loops pick their batches, the library's, it guesses each
  one's samples from its newest applied push, as a follower shard guesses a round from the last certificate). As a
  streamed push's dense float32 gradient arrives, the transport reports how many of its values are in
  (:meth:`SlicePipeline.arrived`). Once every worker of the round has a slice's values (``slice_elements`` of them),
  the slice's mean (:func:`~src.ps.state.aggregation.weighted_mean`) and its optimizer step
  (:func:`~src.training.optimizers.stepped_slice`) are computed on copies: the model and the optimizer's state are
  not touched. The result goes to each worker's connection (its :class:`Sink`) marked provisional.
* **Confirmed at the barrier.** The barrier runs the step as it always does, on every push that made it. Then each
  provisional slice is compared with the stepped parameters, bit for bit (:meth:`SlicePipeline.omitted`, once per
  version). A worker's reply lists the tensors whose every slice it was sent and that all matched
  (``PushReply.provisional``), and carries only the others. The worker loads the listed ones from what it was sent.
* **Nothing depends on a guess.** A worker that failed mid-push (the barrier then steps without it), a push with
  other sample counts or its own learning rate, a gradient that was refused, an optimizer other than SGD: each only
  makes slices fail the comparison (or never be computed), and those tensors travel in the reply as before. The
  model, its versions, the events and the coverage are those of the run without pipelining.

No I/O (a ``provisional`` trace span per slice stepped). The transport owns the sinks (:class:`Sink`: how a frame
reaches a worker); a worker is attached to the connection its last push came on (:meth:`SlicePipeline.attach`), and
its next push's values are reported from there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from src.ps.state.aggregation import ModelState, weighted_mean
from src.telemetry import tracing
from src.training.optimizers import stepped_slice
from src.transport.sinks import Sink

ELEMENT_BYTES = 4
"""A float32 value: what a dense gradient and a provisional slice carry per entry."""


@dataclass
class _Round:
    """One sync round as the pipeline sees it."""

    version: int
    workers: list[int]  # the round's workers, in the barrier's order (worker id)
    samples: list[int]  # the samples handed to each (the barrier weighs its pushes by theirs)
    arrived: dict[tuple[int, int], tuple[Any, int]] = field(default_factory=dict)  # (worker, index) -> (values, count)
    stepped: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(default_factory=dict)  # -> (stop, values)
    sent: dict[Sink, set[tuple[int, int]]] = field(default_factory=dict)
    confirmed: set[tuple[int, int]] | None = None  # once compared with the barrier's step
    off: bool = False  # the optimizer's step cannot be told from a slice: nothing is stepped early this round


class SlicePipeline:
    """A sync server's provisional slices (see the module docstring).

    Args:
        state: the served model (its parameters, optimizer and version).
        slice_elements: values per slice (a tensor of fewer is one slice).
    """

    def __init__(self, state: ModelState, slice_elements: int):
        if slice_elements <= 0:
            raise ValueError(f"slice_elements must be positive, got {slice_elements}")
        self.state = state
        self.slice_elements = slice_elements
        self._lock = threading.Lock()
        self._sinks: dict[int, Sink] = {}
        self._rounds: list[_Round] = []  # the open round last; the one before kept until its replies are built
        self.counts = {"slices_sent": 0, "slices_confirmed": 0, "slices_voided": 0, "tensors_omitted": 0}
        """Slices sent provisionally (per worker), confirmed and voided at their barrier (once each), and tensors
        left out of replies because the worker had them (per reply)."""
        self._voided: list[tuple[int, int, int]] = []  # (version, slices voided, slices stepped), not yet taken

    # ------------------------------------------------------------------------- the server's side (core lock held)

    def attach(self, worker: int, sink: Sink) -> None:
        """``worker``'s pushes come on ``sink``'s connection now: its next push's values are reported there."""
        with self._lock:
            old = self._sinks.get(worker)
            if old is not None and old is not sink:
                old.worker = None
            sink.worker = worker
            self._sinks[worker] = sink

    def open_round(self, version: int, handed: dict[int, int]) -> None:
        """The sync round for ``version`` opened: ``handed`` maps each of its workers to the samples handed to it (a
        worker of none is left out: its push, a skipped step's, carries no gradient to wait for)."""
        handed = {worker: samples for worker, samples in handed.items() if samples > 0}
        workers = sorted(handed)
        with self._lock:
            for previous in self._rounds:
                previous.arrived.clear()  # its pushes' buffers are the barrier's now (or dropped): not held here
            self._rounds = [*self._rounds[-1:], _Round(version, workers, [handed[w] for w in workers])]

    def omitted(self, sink: Sink | None) -> list[int]:
        """The parameters a reply on ``sink`` (the connection it goes on) may leave out: every slice of each was sent
        to ``sink`` and equals what the barrier's step made. Compares once per version; call it with the core
        lock held, after the step and before the model changes again."""
        if sink is None:
            return []
        with self._lock:
            done = next((r for r in self._rounds if r.version + 1 == self.state.version), None)
            if done is None:
                return []
            if done.confirmed is None:
                done.confirmed = self._confirm(done)
                done.stepped.clear()  # compared: the provisional values are not needed any more
            sent = done.sent.get(sink, set()) & done.confirmed
            omitted = []
            for index, param in enumerate(self.state.params):
                starts = range(0, param.numel(), self.slice_elements)
                if all((index, start) in sent for start in starts):
                    omitted.append(index)
            self.counts["tensors_omitted"] += len(omitted)
            return omitted

    def _confirm(self, done: _Round) -> set[tuple[int, int]]:
        confirmed = set()
        for (index, start), (stop, values) in done.stepped.items():
            if torch.equal(values, self.state.params[index].detach().reshape(-1)[start:stop]):
                confirmed.add((index, start))
        voided = len(done.stepped) - len(confirmed)
        self.counts["slices_confirmed"] += len(confirmed)
        self.counts["slices_voided"] += voided
        if voided:
            self._voided.append((done.version + 1, voided, len(done.stepped)))
        return confirmed

    def omitted_logged(self, sink: Sink | None, log: Any) -> list[int]:
        """:meth:`omitted`, and a ``provisional_voided`` event in ``log`` for each version whose barrier voided
        slices since (what either server core does before a reply)."""
        omit = self.omitted(sink)
        for version, voided, stepped in self.take_voided():
            log.event("provisional_voided", version=version, slices=voided, stepped=stepped)
        return omit

    def take_voided(self) -> list[tuple[int, int, int]]:
        """The versions whose barrier voided provisional slices since the last call: ``(version, slices voided,
        slices stepped)`` each (the server logs them: a worker that dropped out mid-push shows here)."""
        with self._lock:
            voided, self._voided = self._voided, []
        return voided

    # ------------------------------------------------------------------------- the transport's side (no core lock)

    def arrived(self, sink: Sink, index: int, values, count: int) -> None:
        """The first ``count`` float32 values of gradient ``index`` of the push arriving on ``sink`` are in
        ``values`` (a buffer the transport goes on filling); steps and sends every slice that is now in from every
        worker of the round."""
        with self._lock:
            worker = sink.worker
            open_round = self._rounds[-1] if self._rounds else None
            if (
                open_round is None
                or open_round.off
                or worker not in open_round.workers
                or index >= len(self.state.params)
            ):
                return
            numel = self.state.params[index].numel()
            count = min(count, numel)
            before = open_round.arrived.get((worker, index))
            was = before[1] if before is not None and before[0] is values else 0
            open_round.arrived[(worker, index)] = (values, count)
            for start in range(was - was % self.slice_elements, count, self.slice_elements):
                stop = min(start + self.slice_elements, numel)
                if stop > count or (index, start) in open_round.stepped:
                    continue
                if all(open_round.arrived.get((w, index), (None, 0))[1] >= stop for w in open_round.workers):
                    self._step(open_round, index, start, stop)

    def _step(self, round_: _Round, index: int, start: int, stop: int) -> None:
        with tracing.span("provisional", part=index, start=start):
            gradients = [_floats(round_.arrived[(w, index)][0], start, stop) for w in round_.workers]
            if len(gradients) == 1:
                mean = gradients[0]
            else:
                mean = weighted_mean([[g] for g in gradients], round_.samples, [torch.empty(stop - start)])[0]
            values = stepped_slice(self.state.optimizer, self.state.params[index], mean, start, stop)
        if values is None:
            round_.off = True
            return
        round_.stepped[(index, start)] = (stop, values)
        for worker in round_.workers:
            sink = self._sinks.get(worker)
            if sink is None or sink.closed or sink.worker != worker:
                continue
            sink.send(round_.version, index, start, values)
            round_.sent.setdefault(sink, set()).add((index, start))
            self.counts["slices_sent"] += 1


def _floats(values, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the float32 buffer ``values``, without a copy."""
    return torch.frombuffer(values, dtype=torch.float32, count=stop - start, offset=ELEMENT_BYTES * start)


def slice_elements_of(slice_bytes: int) -> int:
    """Values per slice for ``system.pipeline_slice_bytes``: whole float32 values, a multiple of 64 (so a slice's
    vectorized arithmetic lines up with the whole tensor's), at least 64."""
    return max(64, (slice_bytes // ELEMENT_BYTES) // 64 * 64)
