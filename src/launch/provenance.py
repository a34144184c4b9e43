"""Where a result came from: the commit of the code that produced it, whether that tree had changes, and the
kernels that computed it.

An experiment record (``experiment.json`` of :mod:`scripts.run_experiment`) keeps all three, so a committed
result can be traced to the code that made it (``git show COMMIT``) and to the CPU kernels its floats came from
(:func:`kernels`): the same code on a CPU with other vector instructions moves a loss in its sixth digit.
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


def kernels() -> dict[str, str]:
    """``{"cpu_capability": ..., "cpu_isa": ..., "torch_version": ...}``: the vector instructions torch's CPU
    kernels use here (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ``DEFAULT``, ...), the
    vector and matrix extensions the CPU has (:func:`cpu_isa`), and torch's version.

    Two runs of one config agree to the last bit only where all three match: a float sum's order is the kernel's,
    and the math libraries under torch pick their kernels by the extensions, not only by the widest vectors (an
    Intel CPU with AMX and AVX-512 FP16 moved F11's loss in its sixth digit against another AVX512 one;
    docs/findings.md, "Records across CPUs")."""
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_isa": cpu_isa(),
        "torch_version": torch.__version__,
    }


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vector and matrix extensions that kernels are picked by (its ``avx*``, ``amx*``, ``fma*`` and
    ``*vnni*`` flags, sorted, space-separated), read from ``cpuinfo``; ``unknown`` where there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(sorted({f for f in flags if f.startswith(("avx", "amx", "fma")) or "vnni" in f})) or "unknown"
