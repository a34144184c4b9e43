"""One streamed push as a client moves it (``system.streaming``), whatever the transport: its parts as backward
produces the gradients, then its small fields; and its reply, taken as it arrives.

The worker's side (:mod:`src.ps.worker.streaming`) feeds a :class:`PushStream`: :meth:`PushStream.ready` for each
gradient as backward produces it (called from autograd's thread: it only queues the index), and
:meth:`PushStream.close` with the push's small fields once backward is done. A client's
``push_streamed(stream)`` runs on its own thread: it takes the parts from :meth:`PushStream.parts` (each gradient
compensated and compressed there, by the worker's ``encode``, as soon as it is ready), sends each as a part
(:func:`part_pieces`: the tensor's index, then its payload) while backward goes on, then the push itself, and
reads the one reply with :meth:`PushStream.splitter`: a :class:`~src.transport.wire.MessageSplitter` that hands
the reply's small fields over as soon as they are in (:meth:`PushStream.wait_head`: the verdict, the version, the
next work) and each tensor as soon as it is whole (the worker's ``on_large``, which loads it into the model for
the forward that waits for it).

A failure before the reply's head leaves the push unsettled: the client sends it again (the parts already
encoded, then the rest; the server applies a request id at most once), as any call. Once the head is in, the
push is settled: a failure after it ends the call, and :meth:`PushStream.fail` wakes whatever waits on the
tensors, which pulls the parameters instead.

The server's side of the parts is :mod:`src.ps.state.streamed_parts`.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from typing import Any, Callable, Iterator

from src.transport.wire import MessageSplitter, Outgoing, Received, chunk_size

PART_INDEX = struct.Struct("<I")
"""A part's leading field: the index of the tensor (parameter) whose gradient payload follows."""
PROVISIONAL_HEAD = struct.Struct("<qII")
"""A provisional slice's leading fields (``system.pipelined_replies``, :mod:`src.ps.state.slice_pipeline`): the version
of the round that stepped it, the parameter's index and the slice's first element; its float32 values follow."""
_VALUE_BYTES = 4  # a provisional slice's values are float32
_CLOSE, _ABORT = object(), object()


def part_pieces(index: int, payload: Any) -> list[Any]:
    """The buffers of a part (gradient ``index``'s payload, a buffer or a tuple of them) as it travels."""
    pieces = payload if isinstance(payload, tuple) else (payload,)
    return [PART_INDEX.pack(index), *pieces]


def part_size(payload: Any) -> int:
    """Bytes of the part carrying ``payload``."""
    return PART_INDEX.size + chunk_size(payload)


def split_part(body) -> tuple[int, memoryview]:
    """A received part's tensor index and payload (a view of ``body``).

    Raises:
        ValueError: shorter than its index.
    """
    view = memoryview(body).cast("B")
    if len(view) < PART_INDEX.size:
        raise ValueError(f"a push part of {len(view)} bytes holds no tensor index")
    return PART_INDEX.unpack_from(view)[0], view[PART_INDEX.size :]


class ReplyBroken(RuntimeError):
    """The reply of a streamed push broke off after its head: the push is settled, the parameters are not all in."""


def staged_slice(body) -> tuple[int, int, int, memoryview]:
    """A provisional slice as it arrived (``body``: :data:`PROVISIONAL_HEAD`, then its float32 values): ``(version,
    parameter index, first element, values)``."""
    version, index, start = PROVISIONAL_HEAD.unpack_from(body)
    return version, index, start, memoryview(body)[PROVISIONAL_HEAD.size :]


def joined_slices(staged, index: int, version: int) -> memoryview:
    """Parameter ``index``'s values from its provisional ``staged`` slices (``(version of their round, first element,
    values)`` each) of the round that made ``version``: whole, in element order.

    Raises:
        ValueError: they leave a gap (one did not arrive).
    """
    pieces = sorted((start, values) for round_version, start, values in staged if round_version + 1 == version)
    filled = 0
    for start, values in pieces:
        if start * _VALUE_BYTES != filled:
            raise ValueError(f"the reply holds parameter {index} provisional, but its slices leave a gap")
        filled += len(values)
    return memoryview(b"".join(values for _, values in pieces)) if len(pieces) != 1 else pieces[0][1]


class SliceStage:
    """Provisional slices kept until the reply that names them comes (``system.pipelined_replies``): a sharded
    server's follower steps a hold's slices and sends them on the hold's connection, and the pull that follows on
    that connection lists what its step confirmed (``PullReply.provisional``), leaving those parameters out."""

    def __init__(self) -> None:
        self.slices: dict[int, list[tuple[int, int, memoryview]]] = {}  # parameter -> (round version, start, values)
        self.nbytes = 0  # the slices' bytes, as their transport counts them

    def add(self, body, size: int | None = None) -> None:
        """A provisional slice arrived (``body``: :data:`PROVISIONAL_HEAD`, then its values; ``size``: its bytes as
        its transport counts them, default ``len(body)``)."""
        version, index, start, values = staged_slice(body)
        self.slices.setdefault(index, []).append((version, start, values))
        self.nbytes += len(body) if size is None else size

    def clear(self) -> None:
        self.slices.clear()
        self.nbytes = 0

    def fill(self, reply: Received) -> int:
        """Put each parameter ``reply`` leaves out (its message's ``provisional``) in place from its slices, then
        forget every slice (what the reply did not name is void); returns the bytes the slices took (:attr:`nbytes`:
        what the reply's call received besides the reply).

        Raises:
            ValueError: a named parameter's slices did not all come (a server's bug).
        """
        staged = self.nbytes
        try:
            parameters = reply.large.get("parameters", [])
            for index in reply.message.provisional:
                parameters[index] = joined_slices(self.slices.get(index, ()), index, reply.message.version)
        finally:
            self.clear()
        return staged


class PushStream:
    """One streamed push: what the worker hands in and what the client's thread sends and receives (see the module
    docstring).

    Args:
        encode: gradient ``index``'s payload (compensated and compressed); called on the client's thread, once per
            gradient, in the order they became ready.
        on_large: ``on_large(field name, index, view)`` of the reply (:class:`~src.transport.wire.MessageSplitter`),
            called on the client's thread as each tensor is whole.
    """

    def __init__(self, encode: Callable[[int], Any], on_large: Callable[[str, int, memoryview], Any]):
        self.encode = encode
        self.on_large = on_large
        self.pieced = True
        """A transport that hands a server each message whole (gRPC) sends a large part in pieces, so that a server
        stepping slices as values arrive (``system.pipelined_replies``) sees them come; a worker whose server does not
        pipeline turns it off (its parts then go whole, one copy fewer on each side)."""
        self.encoded: list[tuple[int, Any]] = []  # (index, payload), in the order sent: a retry sends them again
        self.encode_s = 0.0  # seconds spent in ``encode``
        self.request: Outgoing | None = None  # the push's small fields and buffers, once closed
        self.reply_bytes = 0  # the reply's size, as its transport counts it (once its head is in)
        self.sent_bytes = 0  # every byte of every attempt, as the transport counts them
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._head = threading.Event()
        self._head_message: Any = None
        self._error: BaseException | None = None
        self.first_sent: float | None = None  # perf_counter when the first part went out
        self._staged = SliceStage()  # provisional slices of this attempt
        self._provisional: frozenset[int] = frozenset()  # the reply's parameters that its head says we hold
        self.problem: str | None = None
        """What was wrong with this attempt's reply head (it names a provisional slice that did not come): the
        transport fails the attempt, which is then sent again (the server answers a retry whole)."""

    # ------------------------------------------------------------------------- the worker's side

    def ready(self, index: int) -> None:
        """Gradient ``index`` is computed: encode and send it (from any thread; only queues it)."""
        self._ready.put(index)

    def close(self, request: Outgoing, before_send: Callable[[], None] | None = None) -> None:
        """Every gradient is ready (``ready`` was called for each): the push's small fields and buffers follow.
        ``before_send``: called on the client's thread once every part is out, just before the push's message is
        encoded (to fill in what only then is known: the seconds spent encoding the parts)."""
        self._ready.put((_CLOSE, request, before_send))

    def abort(self, error: BaseException) -> None:
        """The push will not be completed (the step was given up before its backward): the client's thread stops
        with ``error`` instead of waiting for parts."""
        self._ready.put((_ABORT, error, None))

    def wait_head(self, timeout: float | None = None) -> Any:
        """The reply's small fields (its message without tensors), once they are in.

        Raises:
            BaseException: what ended the call before the head came (the client's error).
            TimeoutError: ``timeout`` passed.
        """
        if not self._head.wait(timeout):
            raise TimeoutError("no reply head within the timeout")
        if self._head_message is None:
            raise self._error
        return self._head_message

    @property
    def has_head(self) -> bool:
        return self._head_message is not None

    # ------------------------------------------------------------------------- the client's side

    def parts(self) -> Iterator[tuple[int, Any]]:
        """Every part, as soon as it is ready: the ones already encoded (a retry) first, then each new one (encoded
        here). Ends when the worker has closed the push (:attr:`request` is then set)."""
        yield from list(self.encoded)
        while self.request is None:
            item = self._ready.get()
            if isinstance(item, tuple):
                what, value, before_send = item
                if what is _ABORT:
                    raise value
                if before_send is not None:
                    before_send()
                self.request = value
                return
            started = time.perf_counter()
            payload = self.encode(item)
            self.encode_s += time.perf_counter() - started
            self.encoded.append((item, payload))
            yield item, payload

    def attempt(self) -> None:
        """A new attempt of the push begins: provisional slices of an earlier one do not count."""
        self._staged.clear()
        self.problem = None

    def provisional(self, body, size: int) -> None:
        """A provisional slice arrived (``system.pipelined_replies``; ``body``: a PROVISIONAL frame's, ``size``: the
        frame's bytes): kept until the reply's head says whether it stands."""
        self._staged.add(body, size)

    def unclaimed(self, stage: SliceStage) -> None:
        """Hand this attempt's slices that its reply did not take to ``stage`` (a shard's hold: its acknowledgement
        takes none; the pull after it on the same connection names them)."""
        for index, slices in self._staged.slices.items():
            if index not in self._provisional:
                stage.slices.setdefault(index, []).extend(slices)

    def _load_provisional(self, message: Any) -> None:
        """The head names the parameters whose provisional slices stand: each goes to the worker whole.

        Raises:
            ValueError: the head names one whose slices did not all arrive on this attempt (a server's bug).
        """
        self._provisional = frozenset(message.provisional)
        for index in message.provisional:
            self.on_large(
                "parameters", index, joined_slices(self._staged.slices.get(index, ()), index, message.version)
            )

    def sent(self, size: int) -> None:
        """The transport sent ``size`` bytes of this push."""
        if self.first_sent is None:
            self.first_sent = time.perf_counter()
        self.sent_bytes += size

    def splitter(self, data, message_type, large_fields, reply_bytes: int) -> MessageSplitter:
        """A splitter of the reply arriving into ``data``, whose head and tensors go where the worker waits
        (``reply_bytes``: its size as the transport counts it)."""

        def head(message: Any) -> None:
            if getattr(message, "provisional", None):
                try:
                    self._load_provisional(message)
                except (ValueError, IndexError) as exc:  # a slice missing, or a parameter the model lacks
                    self.problem = str(exc)  # the head is not given: the transport fails this attempt
                    return
            self.reply_bytes = reply_bytes + self._staged.nbytes
            self._head_message = message
            self._head.set()

        def large(name: str, index: int, view) -> Any:
            if name == "parameters" and index in self._provisional and not len(view):
                return None  # loaded from its provisional slices at the head
            return self.on_large(name, index, view)

        return MessageSplitter(data, message_type, large_fields, on_large=large, on_head=head)

    def fail(self, error: BaseException) -> None:
        """The call ended with ``error``: before the head, :meth:`wait_head` raises it; after it, the tensors
        still missing never come (the worker's ``on_large`` side learns it from the call's end)."""
        self._error = error
        self._head.set()
