"""docs/library.md's "Compressed DDP on your own model" example runs as written: its torchrun command, 2 ranks.

The command is run as the page gives it (``torchrun`` is this interpreter's
``-m torch.distributed.run``), from a fresh folder holding the example script; the checkout is put
first on ``PYTHONPATH``, as ``pip install -e .`` would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.ps_fixtures import ROOT, kill_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECTION = "## Compressed DDP on your own model"


def readme_section() -> str:
    text = (ROOT / "docs" / "library.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + 1)]


def test_the_readme_ddp_example_runs_as_written_under_torchrun(tmp_path):
    section = readme_section()
    (script,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (command,) = [
        line
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
        for line in block.splitlines()
        if line.startswith("torchrun ")
    ]
    assert command.endswith(" train_ddp.py") and "--nproc-per-node 2" in command
    (tmp_path / "train_ddp.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        command.replace("torchrun", f"{sys.executable} -m torch.distributed.run", 1),
        shell=True,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = process.communicate(timeout=240)[0]
    finally:
        kill_group(process)
    assert process.returncode == 0, output[-4000:]
    reports = re.findall(r"rank (\d): accuracy ([0-9.]+), sent ([0-9,]+) bytes \(([0-9.]+)x less", output)
    assert sorted(rank for rank, *_ in reports) == ["0", "1"], output[-3000:]
    accuracies = {float(accuracy) for _, accuracy, _, _ in reports}
    print(f"README DDP example: accuracy {accuracies}, {reports}")
    assert len(accuracies) == 1 and min(accuracies) >= 0.85  # replicas agree, and it trained
    assert all(float(ratio) > 4 for *_, ratio in reports)  # top-k 0.1 in bfloat16, after 5 dense steps
    for rank in range(2):
        saved = torch.load(tmp_path / f"checkpoint_rank{rank}.pt", weights_only=True)
        residuals = saved["hook"]["error_feedback"]["residuals"]
        assert set(residuals) == set(saved["model"]) and saved["hook"]["step"] == 3 * 32
