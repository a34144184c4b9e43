"""The local PS launcher's supervision loop (src.launch.ps._await_message) acts on every process's end exactly once,
also on an end that a poll elsewhere (``is_alive``, ``exitcode``) collected before the loop looked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import src.launch.ps as launcher
from src.common.child_processes import process_context
from src.common.supervisor import RejoinGrace


def _exit_with(code: int) -> None:
    raise SystemExit(code)


@pytest.mark.timeout(120)
def test_a_worker_end_collected_by_a_poll_elsewhere_is_still_restarted(monkeypatch):
    context = process_context()
    worker = context.Process(target=_exit_with, args=(3,), name="worker-1")
    worker.start()
    worker.join(60)
    assert worker.exitcode == 3  # collected here, as _kill_hung's or _drain's is_alive() would collect it
    receive, send = context.Pipe(duplex=False)
    run = SimpleNamespace(
        processes=lambda: [worker],
        ended=set(),
        receivers=[receive],
        revoked=RejoinGrace(0.0),
        pipe_of={},
        server=None,
        followers={},
        workers={1: worker},
    )
    restarted = []

    def worker_ended(run, process):
        restarted.append(process.name)
        send.send(("summary", {"restarted": list(restarted)}))

    monkeypatch.setattr(launcher, "_worker_ended", worker_ended)
    assert launcher._await_message(run, "summary", 30) == {"restarted": ["worker-1"]}
    assert run.ended == {worker}
