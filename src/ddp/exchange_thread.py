"""The comm hooks' background exchange: one thread per hook, running bucket exchanges in DDP's order.

A hook returns its future at once and its exchange runs here, while the backward pass goes on
producing the next buckets (``overlap=False`` runs the same work inline). :func:`timed` adds an
exchange's wall time to the hook's :class:`~src.ddp.comm_stats.CommStats`.
"""

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from src.ddp.comm_stats import CommStats


def completed_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor`` (a hook's answer when the work was done inline)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


class ExchangeThread:
    """One background thread running a hook's exchanges in the order they were handed in.

    DDP calls a hook bucket by bucket in the same order on every rank; running the exchanges
    first-in first-out on one thread keeps the collectives in that order, while the backward pass
    carries on computing the next buckets' gradients.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(work())
            except BaseException as exc:  # handed to DDP, which raises it in backward()
                future.set_exception(exc)

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm-hook")
        self._executor.submit(run)
        return future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def run_exchange(state, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """Hand ``work`` to the state's exchange thread, or (``overlap=False``) do it now."""
    if state.overlap:
        return state.thread.submit(work)
    return completed_future(work())


@contextlib.contextmanager
def timed(stats: CommStats) -> Iterator[None]:
    """Add the block's wall time to ``stats.hook_seconds`` (also when it raises)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        stats.hook_seconds += time.perf_counter() - started
