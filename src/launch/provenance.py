"""Where a result came from: the commit of the code that produced it, and whether that tree had changes.

An experiment record (``experiment.json`` of :mod:`scripts.run_experiment`) keeps both, so a committed
result can be traced to the code that made it (``git show COMMIT``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def code_version(root: Path = ROOT) -> dict[str, object]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the git tree at ``root`` (``None``: not a git tree).

    ``dirty`` is whether tracked files under ``src/`` (the code a run executes) differ from the commit; the
    run's config is recorded whole beside it.
    """
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}
