"""Shared helpers for the parameter-server tests: configs, a served server, raw clients, certificates, CLI runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY
from src.config import Config, load_config
from src.parameter_server import ParameterServer
from src.transport.clients import TRANSPORTS, make_client
from tests.python_command import TimedOut, kill_process_group, run_command

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "run_parameter_server_training.py"
TOKEN = "test-token-0123456789"


def ps_config(tmp_path: Path, name: str = "run", **fields: Any) -> Config:
    """A small PS config writing under ``tmp_path/name``; ``fields`` are dotted overrides with ``__`` for ``.``."""
    values = {
        "training.dataset": "mnist_5k",
        "training.batch_size": 16,
        "training.num_epochs": 1,
        "training.max_train_samples": 64,
        "training.max_test_samples": 64,
        "training.learning_rate": 0.05,
        "training.checkpoint_interval": 1000,
        "system.num_workers": 1,
        "system.aggregation_mode": "async",
        "system.checkpoint_dir": str(tmp_path / name / "ckpt"),
        "system.log_dir": str(tmp_path / name / "logs"),
    }
    values.update({key.replace("__", "."): value for key, value in fields.items()})
    return load_config(overrides=values)


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """Each transport in turn (``system.transport``), for the tests that must hold on both."""
    return request.param


class ServedServer:
    """A :class:`ParameterServer` serving on a free loopback port (over the config's ``system.transport``),
    stopped by :meth:`close`."""

    def __init__(self, config: Config, token: str = TOKEN, **kwargs: Any):
        self.server = ParameterServer(config, token=token, tensorboard=False, **kwargs)
        self.transport = self.server.transport
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def client(self, token: str | None = TOKEN, **kwargs: Any):
        """A client of this server's transport (no retries, a 10 s connect timeout unless given)."""
        options = {"retries": 0, "connect_timeout_s": 10, **kwargs}
        return make_client(self.address, transport=self.transport, token=token, **options)

    def worker(self, worker_id: int = 0) -> "RawWorker":
        """A hand-driven worker: registered and holding its first work."""
        return RawWorker(self, worker_id)

    def close(self) -> None:
        self.server.stop(grace=0)


class RawWorker:
    """A worker driven by hand through a raw client: register, pull, then pushes the test composes."""

    def __init__(self, served: ServedServer, worker_id: int):
        self.served = served
        self.client = served.client()
        self.registration = self.client.register(worker_id)
        self.caller = pb.Caller(worker_id=worker_id, session=self.registration.session)
        self.reply = self.client.pull(self.caller)
        self.version = self.reply.message.version
        self.next_request_id = 1
        self.carried: list[pb.Batch] = []  # batches of rejected pushes, listed again in the next one

    @property
    def work(self) -> pb.Work:
        return self.reply.message.work

    def request(self, **fields: Any) -> pb.PushRequest:
        """A valid push of the held work (every field overridable); gradients are identity zeros by default."""
        batches = self.carried + list(self.work.batches)
        values = dict(
            caller=self.caller,
            base_version=self.version,
            request_id=self.next_request_id,
            num_samples=sum(len(b.indices) for b in batches),
            batch_ids=[b.batch_id for b in batches],
            gradients=identity_gradients(self.served.server),
        )
        values.update(fields)
        return pb.PushRequest(**values)

    def push(self, request: pb.PushRequest | None = None):
        """Send ``request`` (default: a valid one); a reply becomes the worker's new state."""
        request = request or self.request()
        self.next_request_id = max(self.next_request_id, request.request_id) + 1
        covered = self.carried + list(self.work.batches)
        reply = self.client.push(request)
        self.carried = [] if reply.message.accepted else [b for b in covered if b.batch_id in request.batch_ids]
        self.reply, self.version = reply, reply.message.version
        return reply

    def close(self) -> None:
        self.client.close()


def identity_gradients(server: ParameterServer, value: float = 0.0) -> list[bytes]:
    """One identity payload per parameter of ``server``'s model, every entry ``value``."""
    return [IDENTITY.compress(torch.full(tuple(spec.shape), value)) for spec in server.param_specs]


def make_self_signed_cert(
    directory: Path, *, name: str = "localhost", alt_names: str = "IP:127.0.0.1,DNS:localhost", days: int = 1
) -> tuple[Path, Path]:
    """A self-signed certificate (``server.crt``) for ``name`` / ``alt_names`` and its key (``server.key``) in
    ``directory``, made with the openssl CLI (docs/deployment.md's command); by default a throwaway one for
    127.0.0.1 and localhost."""
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [
            *"openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes".split(),
            *("-days", str(days), "-subj", f"/CN={name}", "-addext", f"subjectAltName={alt_names}"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def run_process(
    argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` to completion in its own session; its whole process group is killed when it ends or overruns
    (a failed test names the command and what it printed). A Python command is forked with torch imported
    (:mod:`tests.python_command`), anything else is executed."""
    try:
        return run_command(argv, cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)
    except TimedOut as exc:
        command = " ".join(map(str, argv))
        pytest.fail(f"{command} timed out after {timeout}s:\n{exc.stdout[-3000:]}\n{exc.stderr[-3000:]}")


def run_cli(
    args: list[str], *, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the PS runner to completion; kills its whole process group if it overruns."""
    return run_process([sys.executable, str(RUNNER), *args], cwd=cwd, timeout=timeout, env=env)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL every process left in ``process``'s session/group (the runner and its children)."""
    kill_process_group(process.pid)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members
