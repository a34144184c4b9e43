"""What the worker's step machine asks its driver to send, and what it is given back: :class:`Call` and exchanges.

An **exchange** is a generator (:data:`Exchange`): it yields the calls to make at once, a list of :class:`Call`, and
is sent their replies in the same order, then yields the next calls, until it returns its outcome. A reply is what
the call returned (a :class:`~src.transport.wire.Received` for a Pull or a Push; the reply message of a Register, an
Initialize or a Finish) or the :class:`~src.transport.errors.CallError` it failed with. The machine decides what each
means; a driver only moves the calls (:func:`run_blocking` on threads, or :func:`run_callbacks` on the virtual clock's
events) and keeps time.

    exchange = machine.push(request, payloads, buffers)
    calls = next(exchange)                  # e.g. a hold to every shard
    calls = exchange.send(replies)          # their replies, in order: then the commit to shard 0 ...
    ...                                     # until StopIteration(value): the outcome

Pure: no I/O.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Generator, Sequence, TypeVar

from src.transport.errors import CallError

REGISTER, INITIALIZE, PULL, PUSH, FINISH = "Register", "Initialize", "Pull", "Push", "Finish"
"""The calls a worker makes (the protocol's method names)."""

T = TypeVar("T")
Exchange = Generator[list["Call"], list[Any], T]
"""A conversation with the servers: yields calls, is sent their replies, returns its outcome (module docstring)."""


@dataclass(frozen=True)
class Call:
    """One message to one server shard.

    Attributes:
        shard: the shard it goes to (``0``: the server, or shard 0 of a sharded one).
        method: :data:`REGISTER`, :data:`INITIALIZE`, :data:`PULL`, :data:`PUSH` or :data:`FINISH`.
        message: the request message (its ``caller`` set, but a Register's).
        tensors: its tensor fields by name (a push's ``gradients`` and ``buffers``; an Initialize's ``parameters``
            and ``buffers``).
        streamed: a Push whose parts went ahead on the streamed push open to this shard (``system.streaming``):
            this message closes it, and its reply is the reply's head (its tensors follow by themselves).
    """

    shard: int
    method: str
    message: Any
    tensors: dict[str, Sequence[Any]] = field(default_factory=dict)
    streamed: bool = False


def failure_in(replies: Sequence[Any]) -> CallError | None:
    """The first failed call among ``replies`` (``None``: every call returned)."""
    return next((reply for reply in replies if isinstance(reply, CallError)), None)


def run_callbacks(
    exchange: Exchange[T],
    message: Callable[[Call], Callable[[Callable[[Any], None]], None]],
    done: Callable[[T], None],
    *,
    start: Callable[[Callable[[], None]], None] | None = None,
    failed: Callable[[Exception], None] | None = None,
) -> None:
    """Carry ``exchange`` by callbacks (an event loop's): each round's calls are made at once, ``message(call)``
    making one now and returning what sends it (given where its reply, or its
    :class:`~src.transport.errors.CallError`, goes); the next round once every reply is in; ``done(outcome)`` once it
    returns. The first round is sent by ``start(send)`` (default: at once); what the exchange raises goes to
    ``failed(error)`` (default: raised)."""

    def advance(replies: list | None, begin: Callable[[Callable[[], None]], None] | None = None) -> None:
        try:
            calls = exchange.send(replies)
        except StopIteration as stop:
            done(stop.value)
            return
        except Exception as error:
            if failed is None:
                raise
            failed(error)
            return
        senders = [message(call) for call in calls]
        replies_in: list = [None] * len(calls)
        pending = [len(calls)]

        def arrived(index: int, reply: Any) -> None:
            replies_in[index] = reply
            pending[0] -= 1
            if pending[0] == 0:
                advance(replies_in)

        def send() -> None:
            for index, sender in enumerate(senders):
                sender(partial(arrived, index))

        (begin or (lambda go: go()))(send)

    advance(None, start)


def run_blocking(exchange: Exchange[T], perform: Callable[[Call], Any], pool: Executor | None = None) -> T:
    """Run ``exchange`` with blocking calls: ``perform(call)`` returns the call's reply or raises its
    :class:`~src.transport.errors.CallError`; the calls yielded together go at once on ``pool`` (``None``: one after
    the other). Returns the exchange's outcome; raises what the exchange raises."""

    def reply_of(call: Call) -> Any:
        try:
            return perform(call)
        except CallError as error:
            return error

    replies = None  # send(None) starts the exchange
    while True:
        try:
            calls = exchange.send(replies)
        except StopIteration as stop:
            return stop.value
        if pool is None or len(calls) == 1:
            replies = [reply_of(call) for call in calls]
        else:
            replies = [future.result() for future in [pool.submit(reply_of, call) for call in calls]]


__all__ = ["Call", "Exchange", "FINISH", "INITIALIZE", "PULL", "PUSH", "REGISTER", "failure_in"]
__all__ += ["run_blocking", "run_callbacks"]
