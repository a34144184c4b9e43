"""docs/library.md's "Use it in your own training loop" examples run as written: the server command, then
each example script as two worker processes (only the port is changed, to a free one); and they import
nothing of the framework's internals (a user's own loop needs only torch, torch_asgc and its integration)."""

from __future__ import annotations

import ast
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ps_fixtures import ROOT, kill_group
from tests.python_command import ForkedPopen, forkable

EXAMPLES = ["train.py", "train_lightning.py", "train_hf.py"]
USER_PACKAGES = {"sys", "torch", "torch_asgc", "pytorch_lightning", "transformers"}

README_PORT = "50051"


def readme_section() -> str:
    text = (ROOT / "docs" / "library.md").read_text()
    start = text.index("## Use it in your own training loop")
    return text[start : text.index("\n## ", start + 1)]


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", readme_section(), flags=re.S)


def server_command() -> str:
    line = next(line for line in code_blocks("bash")[0].splitlines() if line.startswith("python -m torch_asgc.server"))
    return line.removesuffix("&").strip()


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def start(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen | ForkedPopen:
    """``command`` (no shell syntax) started in its own session, stderr into stdout; forked when it can be."""
    argv = shlex.split(command)
    if forkable(argv, env):
        return ForkedPopen(argv, cwd=cwd, env=env, merge_stderr=True)
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_the_examples_import_only_torch_torch_asgc_and_their_integration():
    scripts = code_blocks("python")
    assert len(scripts) == len(EXAMPLES)
    for name, script in zip(EXAMPLES, scripts):
        imported = set()
        for node in ast.walk(ast.parse(script)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
        assert "torch_asgc" in imported and imported <= USER_PACKAGES, (name, imported - USER_PACKAGES)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("example", EXAMPLES)
def test_readme_example_runs_as_written(tmp_path, example):
    pytest.importorskip(
        {"train.py": "torch", "train_lightning.py": "pytorch_lightning", "train_hf.py": "transformers"}[example]
    )
    script = code_blocks("python")[EXAMPLES.index(example)]
    port = free_port()
    (tmp_path / example).write_text(script.replace(README_PORT, port))
    env = {**os.environ, "DTS_AUTH_TOKEN": "readme-test-token-0123456789", "HF_HUB_OFFLINE": "1"}
    python = sys.executable
    server = start(server_command().replace(README_PORT, port).replace("python ", f"{python} ", 1), tmp_path, env)
    workers = [start(f"{python} {example} {k}", tmp_path, env) for k in range(2)]
    try:
        outputs = [w.communicate(timeout=400)[0] for w in workers]
        server_output = server.communicate(timeout=60)[0]
    finally:
        for process in [server, *workers]:
            kill_group(process)
    for k, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, f"{example} {k} failed:\n{output[-3000:]}"
    assert server.returncode == 0, server_output[-3000:]
    assert "Checkpoint: checkpoints/asgc_server/parameter_server_final.pt" in server_output, server_output[-2000:]
    assert (tmp_path / "checkpoints" / "asgc_server" / "parameter_server_final.pt").is_file()
    if example == "train.py":
        accuracies = [float(re.search(r"test accuracy ([0-9.]+)", output).group(1)) for output in outputs]
        print(f"README train.py: test accuracies {accuracies}")
        assert min(accuracies) >= 0.85, outputs
