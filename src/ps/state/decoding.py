"""The served model's layout, and the check and decompression of a push against it.

A push is decoded outside the core's lock (pushes decode in parallel): this reads only the layout,
fixed once the model is installed. Every problem is a :class:`~src.ps.state.refusals.PushRefused` that
names the tensor or the field. A receiver that reads a push in pieces (TCP) checks and decodes its
gradients as they arrive (:class:`ArrivingPush`, :func:`arriving_push_splitter`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from src import parameter_server_pb2 as pb
from src.compression import decompress, parse_header
from src.compressors.checks import all_finite
from src.compressors.payload_format import HEADER_SIZE, Kind
from src.ps.state.aggregation import Contribution, ModelState
from src.ps.state.model_sources import layout_mismatch
from src.transport.errors import PushRefused
from src.transport.wire import MessageSplitter, Received, check_float32_bytes

_FLOAT32_LE = np.dtype("<f4")  # the wire's float32


def _spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, shape=list(tensor.shape))


class ModelLayout:
    """Names and shapes of the served model's parameters and buffers (what Register replies describe)."""

    def __init__(self, state: ModelState):
        self.param_names, self.buffer_names = state.param_names, state.buffer_names
        self.param_specs = [_spec(n, p) for n, p in zip(state.param_names, state.params)]
        self.buffer_specs = [_spec(n, b) for n, b in zip(state.buffer_names, state.buffers)]
        self.param_shapes = [tuple(p.shape) for p in state.params]
        self.buffer_shapes = [tuple(b.shape) for b in state.buffers]
        self.buffer_numels = [b.numel() for b in state.buffers]

    def mismatch(self, layout: tuple[list, list]) -> str | None:
        """What differs between ``(parameters, buffers)`` (name and shape pairs) and this layout (``None``: nothing)."""
        return layout_mismatch(layout, (self.param_names, self.param_shapes), (self.buffer_names, self.buffer_shapes))

    def decode(self, worker_id: int, received: Received, *, owns_data: bool) -> Contribution:
        """Check and decompress a push's tensors; raises :class:`PushRefused` naming the problem.

        ``owns_data``: the workers choose their own samples (a push without tensors is a skipped step).
        """
        request, payloads, raw_buffers = received.message, received.large["gradients"], received.large["buffers"]
        learning_rate = request.learning_rate if request.HasField("learning_rate") else None
        if learning_rate is not None and not (math.isfinite(learning_rate) and learning_rate >= 0):
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"push from worker {worker_id}: learning_rate must be a finite "
                f"number >= 0 (or not set), got {learning_rate}",
            )
        if owns_data:
            if not payloads and not raw_buffers:
                if request.num_samples != 0:
                    raise PushRefused(
                        "INVALID_ARGUMENT",
                        f"push from worker {worker_id} has no gradients but num_samples "
                        f"{request.num_samples} (a skipped step has num_samples 0)",
                    )
                return Contribution(worker_id, 0, [], [], request.request_id)  # a skipped step
            if request.num_samples <= 0:
                raise PushRefused(
                    "INVALID_ARGUMENT",
                    f"push from worker {worker_id}: num_samples must be > 0, got {request.num_samples}",
                )
        gradients = self._gradients(payloads, received.early)
        buffers = self._buffers(raw_buffers) if raw_buffers else []
        return Contribution(
            worker_id,
            request.num_samples,
            gradients,
            buffers,
            request.request_id,
            learning_rate=learning_rate,
            payload_bytes=sum(memoryview(p).nbytes for p in payloads),
        )

    def _gradients(self, payloads: list, early: dict) -> list[torch.Tensor]:
        """Each parameter's gradient (:meth:`gradient`; those decoded as the push arrived are taken from ``early``)."""
        if len(payloads) != len(self.param_shapes):
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"push carries {len(payloads)} gradients, the model has {len(self.param_shapes)} parameters",
            )
        gradients = []
        for index, payload in enumerate(payloads):
            view, result = early.get(("gradients", index), (None, None))
            if view is not payload or result is None:  # not decoded while the push arrived
                result = self.gradient(index, payload)
            if isinstance(result, PushRefused):
                raise result
            gradients.append(result)
        return gradients

    def gradient(self, index: int, payload, *, finite_values: int = 0) -> torch.Tensor | PushRefused:
        """Gradient ``index``, decompressed after its header was checked against the parameter's shape, or
        the refusal naming what is wrong with it (returned, not raised: a receiver may decode a push's
        gradients as they arrive, and refuse the push once all of it is in). ``finite_values``: leading
        values of an identity payload checked finite as they arrived (:class:`ArrivingPush`). No lock needed."""
        if index >= len(self.param_shapes):
            return PushRefused(
                "INVALID_ARGUMENT", f"gradient {index}: the model has {len(self.param_shapes)} parameters"
            )
        try:
            header = parse_header(payload)  # before decompressing: the header bounds the allocation
            if header.shape != self.param_shapes[index]:
                raise ValueError(f"shape {list(header.shape)}, expected {list(self.param_shapes[index])}")
            # copy=False: identity gradients stay read-only views of the message (nothing writes them)
            # refuses malformed buffers and NaN/Inf
            return decompress(payload, copy=False, header=header, finite_values=finite_values)
        except ValueError as exc:
            return PushRefused("INVALID_ARGUMENT", f"gradient {index} ({self.param_specs[index].name}): {exc}")

    def identity_values(self, index: int, payload) -> bool:
        """Whether ``payload`` (only its header need have arrived) is gradient ``index`` as float32 identity
        values: what :meth:`gradient` checks in place, and so what can be checked as it arrives."""
        if index >= len(self.param_shapes):
            return False
        try:
            header = parse_header(payload)
        except ValueError:
            return False  # refused with its reason once the push is in
        identity = header.kind == Kind.IDENTITY and header.value_dtype == torch.float32
        return identity and header.shape == self.param_shapes[index]

    def _buffers(self, raw_buffers: list) -> list[torch.Tensor]:
        """The pushed buffers (float32, finite), one per model buffer."""
        if len(raw_buffers) != len(self.buffer_shapes):
            raise PushRefused(
                "INVALID_ARGUMENT",
                f"push carries {len(raw_buffers)} buffers, the model has {len(self.buffer_shapes)}",
            )
        for data, spec, numel in zip(raw_buffers, self.buffer_specs, self.buffer_numels):
            try:
                check_float32_bytes(data, numel, f"buffer {spec.name}")
            except ValueError as exc:
                raise PushRefused("INVALID_ARGUMENT", str(exc)) from None
        # One copy of all of them (the push's bytes are not kept) and one check: a model's buffers are many
        # and small (resnet18: 40 of 38 KB in all, 0.7 ms checked and copied one by one, 0.1 ms at once).
        pieces = [np.frombuffer(data, dtype=_FLOAT32_LE) for data in raw_buffers]
        values = np.concatenate(pieces)
        if not all_finite(values):
            bad = next(spec.name for piece, spec in zip(pieces, self.buffer_specs) if not all_finite(piece))
            raise PushRefused("INVALID_ARGUMENT", f"buffer {bad}: holds NaN or Inf values")
        flat = torch.from_numpy(values)
        return [piece.view(shape) for piece, shape in zip(flat.split(self.buffer_numels), self.buffer_shapes)]


FINITE_CHECK_PIECE_BYTES = 256 << 10
"""An arriving identity gradient's values are checked finite in pieces of at least this many bytes.

Checking a whole gradient once it is in (megabytes) keeps the receive waiting meanwhile: the socket's
buffer fills and the sender stalls. Pieces this small (a fraction of the socket buffer) are checked
while the next bytes come in; larger than a few reads, so the cost per check (~2 us) stays small.
"""


class ArrivingPush:
    """One push's gradients checked and decoded while it arrives (the hooks of a
    :class:`~src.transport.wire.MessageSplitter`): an identity gradient's values are checked finite piece by piece
    as its bytes come in (:meth:`partial`), and once it is whole it is decoded with only what is left to
    check (:meth:`complete`). Anything else (another kind, a wrong header, a non-finite value) is left to
    the decode of the whole gradient, which names the problem."""

    def __init__(self, layout: ModelLayout):
        self.layout = layout
        self._finite: dict[int, int] = {}  # gradient index -> its leading values checked finite
        self._scanned: dict[int, bool] = {}  # gradient index -> checked as it arrives (its header says so)

    def partial(self, name: str, index: int, payload: memoryview, arrived: int) -> None:
        """``arrived`` bytes of gradient ``index`` are in: check the values among them not checked yet."""
        if name != "gradients" or arrived < HEADER_SIZE:
            return
        scanned = self._scanned.get(index)
        if scanned is None:
            scanned = self._scanned[index] = self.layout.identity_values(index, payload)
        if not scanned:
            return
        checked, values_in = self._finite.get(index, 0), (arrived - HEADER_SIZE) // 4
        if (values_in - checked) * 4 < FINITE_CHECK_PIECE_BYTES:
            return
        values = np.frombuffer(payload, dtype=np.float32, count=values_in - checked, offset=HEADER_SIZE + 4 * checked)
        if all_finite(values):
            self._finite[index] = values_in
        else:
            self._scanned[index] = False  # the whole gradient's decode finds the value and refuses the push

    def forget(self, index: int) -> None:
        """Count nothing of gradient ``index`` as checked (its whole decode checks every value)."""
        self._scanned[index] = False

    def complete(self, name: str, index: int, payload: memoryview) -> torch.Tensor | PushRefused | None:
        """Gradient ``index`` is whole: decoded (only its values not checked yet are checked), or its
        refusal; ``None`` for a field that is not a gradient."""
        if name != "gradients":
            return None
        finite = self._finite.get(index, 0) if self._scanned.get(index) else 0
        return self.layout.gradient(index, payload, finite_values=finite)


def arriving_push_splitter(layout: ModelLayout | None, data, large_fields) -> MessageSplitter:
    """A splitter of a push arriving into ``data`` (a transport that reads it in pieces: TCP), whose gradients are
    checked as their bytes come in and decoded as soon as each is whole, against ``layout`` (:class:`ArrivingPush`);
    ``None`` (no model yet): split once every byte is in. A decode that fails here on a bug is left to the decode
    of the whole push, which answers it."""
    if layout is None:
        return MessageSplitter(data, pb.PushRequest, large_fields)
    arriving = ArrivingPush(layout)

    def decode(name: str, index: int, payload):
        try:
            return arriving.complete(name, index, payload)
        except Exception:  # noqa: BLE001  (a bug: handle_push decodes it again and answers INTERNAL)
            return None

    def check(name: str, index: int, payload, arrived: int) -> None:
        try:
            arriving.partial(name, index, payload, arrived)
        except Exception:  # noqa: BLE001  (a bug: nothing counted as checked; the whole decode checks)
            arriving.forget(index)

    return MessageSplitter(data, pb.PushRequest, large_fields, on_large=decode, on_partial=check)
