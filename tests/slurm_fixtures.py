"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this machine.

:class:`SlurmCluster` writes ``slurm.conf`` into its own folder and starts Debian's daemons
(``apt-get install slurm-wlm munge``) as a new user of Slurm would on one machine: munged as the
``munge`` user with a key of its own, slurmctld and slurmd as root (``SlurmUser=root``),
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups needed), the node's
CPUs as ``slurmd -C`` finds them and a partition with ``OverSubscribe=FORCE``, so a job may have
more tasks than cores (``--overcommit``). Nothing is shared with another Slurm or munge on the
machine: the munge socket and key, ports, state, spool, pid and log files are all its own.
There is no accounting database (no slurmdbd), so job states come from ``scontrol show job``.

Needs root and the packages; where they are missing the tests skip, except when
``DTS_REQUIRE_SLURM=1`` or ``CI=true`` (``.ci/run`` sets the first): there they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
PARTITION = "dts"
START_TIMEOUT_S = 60.0
FINISHED_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def slurm_unavailable() -> str | None:
    """Why this machine cannot run the cluster, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (slurmctld and slurmd run as root, munged as the munge user)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        return "there is no munge user (the munge package makes it)"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``, or fail where the cluster is required (CI)."""
    if os.environ.get("DTS_REQUIRE_SLURM") == "1" or os.environ.get("CI") == "true":
        pytest.fail(f"the Slurm tests must run here (DTS_REQUIRE_SLURM=1 or CI=true) but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node_hardware() -> str:
    """``CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=..`` as slurmd sees this machine."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", found.splitlines()[0]))
    return " ".join(
        f"{key}={fields[key]}" for key in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    )


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


class SlurmCluster:
    """One node, one partition (:data:`PARTITION`), in a folder of its own; :meth:`stop` ends and removes it all."""

    def __init__(self):
        # Not under pytest's tmp_path: its parents are root's alone (0700), and munged is not root.
        self.root = Path(tempfile.mkdtemp(prefix="dts-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        # Jobs name their nodes to each other (the PS workers dial the server's node), so the node
        # is this host's name where it resolves, as on a cluster.
        try:
            socket.gethostbyname(self.host)
            self.node = self.host
        except OSError:
            self.node = "localhost"
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.logs = self.root / "log"
        self.daemons: list[tuple[str, subprocess.Popen]] = []
        # None of this shell's Slurm or DTS_* settings (a job makes its own auth token).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DTS_"))} | {
            "SLURM_CONF": str(self.conf)
        }

    # -- set-up ------------------------------------------------------------------------------

    def _write_files(self) -> None:
        import pwd

        munge = pwd.getpwnam("munge")
        self.root.chmod(0o755)  # munged (not root) must reach its folder
        for folder in ("state", "spool", "log"):
            (self.root / folder).mkdir()
        self.munge_dir.mkdir(mode=0o755)  # munged refuses a socket folder others cannot search
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        (self.root / "plugstack.conf").write_text("")  # not the host's /etc/slurm/plugstack.conf
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=dtstest",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    f"PlugStackConfig={r}/plugstack.conf",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "MpiDefault=none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/none",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "MinJobAge=3600",  # finished jobs stay in scontrol show job for the test to read
                    "KillWait=10",  # SIGTERM to SIGKILL when a job is cancelled or requeued
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 {_node_hardware()} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE",
                    "",
                ]
            )
        )

    def _daemon(self, name: str, argv: list[str], **kwargs) -> None:
        log = open(self.logs / f"{name}.out", "wb")
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
            **kwargs,
        )
        log.close()
        self.daemons.append((name, process))

    def _wait(self, what: str, ready, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name, process in self.daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} before {what}:\n{self.diagnostics()}")
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {timeout:.0f}s:\n{self.diagnostics()}")

    def start(self) -> None:
        """Write the files, start munged, slurmctld and slurmd; return once ``sinfo`` shows the node idle."""
        self._write_files()
        m = self.munge_dir
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                f"--key-file={m}/munge.key",
                f"--socket={self.munge_socket}",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            user="munge",
            group="munge",
            extra_groups=[],
        )
        self._wait(
            "munge credential",
            lambda: (
                subprocess.run(
                    ["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10
                ).returncode
                == 0
            ),
        )
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(
            "idle node in sinfo", lambda: self.run("sinfo", "-h", "-N", "-o", "%t", check=False).strip() == "idle"
        )

    # -- clients -----------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None) -> str:
        """A Slurm client command against this cluster; its stdout."""
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or self.env)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def submit(
        self, script: Path, args: list[str], *, workdir: Path, env: dict[str, str], options: tuple[str, ...] = ()
    ) -> int:
        """``sbatch`` ``script`` with ``args`` in ``workdir`` (output to ``workdir/slurm-<job>.out``); the job id."""
        out = self.run(
            "sbatch",
            "--parsable",
            f"--chdir={workdir}",
            f"--output={workdir}/slurm-%j.out",
            *options,
            str(script),
            *args,
            env=self.env | env,
        )
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "-o", "show", "job", str(job_id))))

    def wait_for_job(
        self, job_id: int, timeout: float, until=lambda job: job["JobState"] in FINISHED_STATES
    ) -> dict[str, str]:
        """Poll the job until ``until(job)`` (default: it has finished); its record then."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout:.0f}s")
            time.sleep(0.2)

    def steps(self, job_id: int) -> dict[str, str]:
        """The job's running steps: name -> step id (``<job>.<step>``)."""
        found = self.run("squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %j", check=False)
        return {name: step for step, name in (line.split(maxsplit=1) for line in found.splitlines() if line.strip())}

    def step_pids(self, step: str) -> list[int]:
        """The processes Slurm tracks for a step (``scontrol listpids``)."""
        found = self.run("scontrol", "listpids", step, check=False)
        return [int(line.split()[0]) for line in found.splitlines()[1:] if line.strip()]

    def job_processes(self, job_id: int) -> list[int]:
        """Processes still alive that belong to the job (its SLURM_JOB_ID on this cluster)."""
        wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CONF={self.conf}".encode()}
        return [pid for pid, environ in _environments() if wanted <= environ]

    def diagnostics(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{_tail(path)}" for path in sorted(self.logs.glob("*")) + [self.munge_dir / "munged.log"]
        )

    # -- tear-down ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever a job left behind."""
        if any(name == "slurmctld" and process.poll() is None for name, process in self.daemons):
            self.run("scancel", "--quiet", f"--partition={PARTITION}", check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).strip():
                time.sleep(0.5)
        for name, process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        self.daemons.clear()
        ours = f"SLURM_CONF={self.conf}".encode()
        for pid, environ in _environments():
            if ours in environ:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


def _environments() -> list[tuple[int, set[bytes]]]:
    """Every other process's pid and environment entries (readable as root)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            found.append((int(entry.name), set((entry / "environ").read_bytes().split(b"\0"))))
        except OSError:
            continue
    return found
