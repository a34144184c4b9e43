"""One checkpoint format for every architecture, written atomically, loaded safely.

A checkpoint is a plain dict saved with ``torch.save`` and loadable with
``torch.load(path, weights_only=True)``: tensors, numbers, strings, lists and dicts only. Required
keys: :data:`REQUIRED_KEYS`. Architecture-specific state (error-feedback residuals, a comm hook's
step, server version) goes under ``extra``.

Writes go to a temporary file in the same folder, are fsynced, then renamed over the target, so a
crash leaves either the old file or the new one, never half of one. A truncated or corrupt file is
reported as :class:`CheckpointError`; :func:`load_latest_good` walks back to the newest checkpoint
that loads.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = (
    "format_version",
    "model_state_dict",
    "model_architecture",
    "dataset",
    "optimizer_state_dict",
    "epoch",
    "step",
    "config",
)
_NUMBERED = re.compile(r"^checkpoint_(\d+)\.pt$")
KEEP_CHECKPOINTS = 3
"""Numbered checkpoints kept per run folder (older ones are pruned)."""
FINAL_CHECKPOINT_NAMES = {
    "baseline": "baseline_final.pt",
    "parameter_server": "parameter_server_final.pt",
    "ddp": "ddp_final.pt",
}
"""The file each architecture writes at the end of a run, in its checkpoint folder."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, truncated, corrupt or incomplete)."""


def make_checkpoint(
    *,
    model_state_dict: dict[str, torch.Tensor],
    optimizer_state_dict: dict[str, Any] | None,
    model_architecture: str,
    dataset: str,
    epoch: int,
    step: int,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the common checkpoint dict (tensors are detached CPU copies)."""
    return {
        "format_version": FORMAT_VERSION,
        "model_state_dict": {k: v.detach().to("cpu", copy=True) for k, v in model_state_dict.items()},
        "model_architecture": model_architecture,
        "dataset": dataset,
        "optimizer_state_dict": optimizer_state_dict if optimizer_state_dict is not None else {},
        "epoch": int(epoch),
        "step": int(step),
        "config": config,
        "extra": extra or {},
    }


def save_checkpoint(path: str | Path, checkpoint: dict[str, Any]) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temp file, fsync, rename, fsync folder)."""
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(f"checkpoint for {path} lacks required keys: {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint.

    Raises:
        CheckpointError: the file is missing, not a checkpoint, truncated or corrupt, or lacks keys.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, zipfile errors...
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: {exc})") from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} is not a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks required keys: {', '.join(missing)}")
    checkpoint.setdefault("extra", {})
    return checkpoint


def final_checkpoint_path(directory: str | Path, architecture: str) -> Path:
    """``<directory>/<architecture>_final.pt``: where a run of ``architecture`` leaves its final checkpoint."""
    return Path(directory) / FINAL_CHECKPOINT_NAMES[architecture]


def check_model_matches(path: str | Path, checkpoint: dict[str, Any], model_architecture: str) -> None:
    """Raise :class:`CheckpointError` unless ``checkpoint`` (from ``path``) holds a ``model_architecture`` model."""
    if checkpoint["model_architecture"] != model_architecture:
        raise CheckpointError(
            f"--resume {path}: checkpoint is a {checkpoint['model_architecture']!r} model, "
            f"config asks for {model_architecture!r}"
        )


def numbered_path(directory: str | Path, number: int) -> Path:
    """``<directory>/checkpoint_<number>.pt`` (number = epoch or server version)."""
    return Path(directory) / f"checkpoint_{number:06d}.pt"


def numbered_checkpoints(directory: str | Path) -> list[Path]:
    """Numbered checkpoints in ``directory``, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NUMBERED.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def prune_checkpoints(directory: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` numbered checkpoints."""
    for stale in numbered_checkpoints(directory)[keep_last:]:
        stale.unlink(missing_ok=True)


def unfinished_run_checkpoint(directory: str | Path, architecture: str) -> Path | None:
    """The newest numbered checkpoint in ``directory`` if the run there was interrupted, else ``None``.

    Interrupted: a numbered checkpoint was written after the run's final checkpoint (or there is no
    final one). "Newest" is by modification time, not number: a run started afresh in the folder of a
    finished one counts its versions from 0 again. A restarted container can then pass the same
    command every time: it resumes after a crash and starts afresh after a finished run.
    """
    numbered = sorted(numbered_checkpoints(directory), key=lambda p: p.stat().st_mtime, reverse=True)
    if not numbered:
        return None
    final = final_checkpoint_path(directory, architecture)
    if final.is_file() and final.stat().st_mtime >= numbered[0].stat().st_mtime:
        return None
    return numbered[0]


def load_latest_good(target: str | Path) -> tuple[Path, dict[str, Any]]:
    """Load ``target`` (a file or a checkpoint folder); fall back to the newest good checkpoint.

    A file that fails to load is reported with a warning and the numbered checkpoints beside it are
    tried newest first; a folder tries its numbered checkpoints newest first.

    Raises:
        CheckpointError: nothing loadable was found.
    """
    target = Path(target)
    failures: list[str] = []
    candidates: list[Path] = []
    if target.is_dir():
        candidates = numbered_checkpoints(target)
    else:
        candidates = [target] + [p for p in numbered_checkpoints(target.parent) if p != target]
    for candidate in candidates:
        try:
            checkpoint = load_checkpoint(candidate)
        except CheckpointError as exc:
            failures.append(str(exc))
            warnings.warn(f"{exc}; trying an older checkpoint", RuntimeWarning, stacklevel=2)
            continue
        return candidate, checkpoint
    detail = "; ".join(failures) if failures else "no checkpoint files found"
    raise CheckpointError(f"no usable checkpoint at {target}: {detail}")
