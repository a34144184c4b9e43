"""A sharded run's final checkpoint: the whole model, put together from the shards' parts.

Shard 0 writes ``parameter_server_final.pt`` with its part (its slices, flat, and every buffer); each follower
writes ``shard_K_final.pt`` with its own (:class:`src.ps.follower_server.FollowerServer`). :func:`write_whole_final`
replaces shard 0's file with the whole model's ``state_dict`` (:func:`~src.ps.shard_model.whole_state`), in the
common format, so evaluation, validation and the report read a sharded run's model as an unsharded one's. Every
part must be of the final version: a shard that did not apply it is named, and nothing is replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from src.common.checkpoint import CheckpointError, final_checkpoint_path, load_checkpoint, save_checkpoint
from src.ps.placement import Placement
from src.ps.shard_model import whole_state


def shard_part_path(checkpoint_dir: str | Path, shard: int) -> Path:
    """Where follower shard ``shard`` writes its part of the model at the end of the run."""
    return Path(checkpoint_dir) / f"shard_{shard}_final.pt"


def write_whole_final(checkpoint_dir: str | Path, model: nn.Module, placement: Placement) -> dict[str, Any]:
    """Replace shard 0's final checkpoint in ``checkpoint_dir`` with the whole model (``model``: the run's, for its
    names and shapes); returns the checkpoint written.

    Raises:
        CheckpointError: a part is missing, unreadable, or of another version than shard 0's.
    """
    final = final_checkpoint_path(checkpoint_dir, "parameter_server")
    checkpoint = load_checkpoint(final)
    parts = [checkpoint["model_state_dict"]]
    for shard in range(1, placement.num_shards):
        part = load_checkpoint(shard_part_path(checkpoint_dir, shard))
        if part["step"] != checkpoint["step"]:
            raise CheckpointError(
                f"shard {shard} ended at version {part['step']}, shard 0 at version {checkpoint['step']}: the "
                f"shards do not hold one model"
            )
        parts.append(part["model_state_dict"])
    try:
        checkpoint["model_state_dict"] = whole_state(model, placement, parts)
    except KeyError as exc:
        raise CheckpointError(f"the shards' parts do not make the whole model: {exc}") from None
    checkpoint["optimizer_state_dict"] = {}  # each shard's optimizer is over its slices: a resume reads its own
    checkpoint["extra"] = {**checkpoint["extra"], "num_servers": placement.num_shards}
    save_checkpoint(final, checkpoint)
    return checkpoint
