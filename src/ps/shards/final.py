"""A sharded run's final checkpoint: the whole model, put together by shard 0 from every shard's part.

When a sharded run is over, shard 0 (:class:`~src.parameter_server.ParameterServer`) reads each follower's slices
over the run's transport (:func:`collect_parts`: a parameters-only pull carrying the last version's certificate,
under a session shard 0 signs itself for worker 0's newest incarnation, so the follower checks it as any call),
then replaces its own final checkpoint, which holds its part, with the whole model's ``state_dict``
(:func:`write_whole_final`, :func:`~src.ps.shards.parts.whole_state`), in the common format: evaluation,
validation and the report read a sharded run's model as an unsharded one's. Every part must be of the final
version: a shard that did not apply it is named, and nothing is replaced. Shards on other hosts need no shared
disk: the parts travel as pulls do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.common.checkpoint import CheckpointError, final_checkpoint_path, load_checkpoint, save_checkpoint
from src.ps.shards.asynchronous import ROLLED_BACK_HERE
from src.ps.shards.parts import whole_state
from src.ps.shards.placement import Placement
from src.transport.wire import Received


def shard_part_path(checkpoint_dir: str | Path, shard: int) -> Path:
    """Where follower shard ``shard`` writes its part of the model when it stops (for inspection by hand)."""
    return Path(checkpoint_dir) / f"shard_{shard}_final.pt"


def part_of_reply(placement: Placement, shard: int, reply: Received) -> tuple[int, dict[str, torch.Tensor]]:
    """A follower's pull reply as its part's ``state_dict`` (slice key -> flat tensor) and its version."""
    pieces = placement.on_shard(shard)
    sent = reply.large["parameters"]
    if len(sent) != len(pieces):
        raise CheckpointError(f"shard {shard} sent {len(sent)} slices, the placement gives it {len(pieces)}")
    part = {}
    for piece, data in zip(pieces, sent):
        values = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if values.numel() != piece.numel:
            raise CheckpointError(f"shard {shard} sent {values.numel()} values of {piece.key}, not {piece.numel}")
        part[piece.key] = values
    return reply.message.version, part


def collect_parts(
    clients: list[Any], caller: pb.Caller, certificate: bytes, final_version: int, placement: Placement
) -> list[dict[str, torch.Tensor]]:
    """Each follower's part at shard 0's ``final_version`` (``clients[k - 1]`` reaches shard ``k``), pulled with
    shard 0's ``certificate`` of it (sync: the last version's; async: the window; empty: none was made).

    Raises:
        CheckpointError: a follower is at another version than shard 0's, or sent a part of another shape.
    """
    parts = []
    for shard, client in enumerate(clients, start=1):
        version, part = part_of_reply(
            placement, shard, client.pull(caller, certificate=certificate, parameters_only=True, final=True)
        )
        if version != final_version:
            raise CheckpointError(
                f"shard {shard} holds version {version}, shard 0 version {final_version}: the shards do not hold "
                f"one model"
            )
        parts.append(part)
    return parts


def write_whole_final(
    checkpoint_dir: str | Path, model: nn.Module, placement: Placement, parts: list[Mapping[str, torch.Tensor]]
) -> dict[str, Any]:
    """Replace shard 0's final checkpoint in ``checkpoint_dir`` with the whole model (``model``: the run's, for its
    names and shapes; ``parts``: the followers', shard 1 first); returns the checkpoint written.

    Raises:
        CheckpointError: the parts do not make the whole model.
    """
    final = final_checkpoint_path(checkpoint_dir, "parameter_server")
    checkpoint = load_checkpoint(final)
    try:
        checkpoint["model_state_dict"] = whole_state(model, placement, [checkpoint["model_state_dict"], *parts])
    except KeyError as exc:
        raise CheckpointError(f"the shards' parts do not make the whole model: {exc}") from None
    checkpoint["optimizer_state_dict"] = {}  # each shard's optimizer is over its slices: a resume reads its own
    checkpoint["extra"] = {**checkpoint["extra"], "num_servers": placement.num_shards}
    save_checkpoint(final, checkpoint)
    return checkpoint


def shard_loads(placement: Placement, loads: list[pb.ShardLoad], *, asynchronous: bool = False) -> dict[str, Any]:
    """The summary's per-shard load (``shards``: bytes placed, bytes in and out, optimizer seconds, and with
    ``asynchronous`` the pushes rolled back there, by shard) and ``shard_imbalance``: the busiest shard's bytes in and
    out over the mean (1.0: even)."""
    placed = placement.bytes_per_shard()
    shards = [
        {
            "shard": shard,
            "bytes_placed": placed[shard],
            "bytes_in": load.bytes_in,
            "bytes_out": load.bytes_out,
            "update_s": round(load.update_s, 6),
            **({"rolled_back": load.rolled_back} if asynchronous else {}),
        }
        for shard, load in enumerate(loads)
    ]
    carried = [s["bytes_in"] + s["bytes_out"] for s in shards]
    mean = sum(carried) / len(carried) if carried else 0
    return {"shards": shards, "shard_imbalance": round(max(carried) / mean, 6) if mean else None}


def reader_session(core: Any) -> tuple[pb.Caller, bytes, int]:
    """What shard 0 (its server ``core``) reads the followers' parts with: a session it signs itself for worker 0's
    newest incarnation (each follower checks it as any call), the certificate of its last version, and that
    version."""
    with core.lock:
        member = core.members.current.get(0)
        incarnation = member.incarnation if member is not None else 0
        caller = pb.Caller(worker_id=0, session=core.members.signer.issue(0, incarnation))
        return caller, core.updates.certificate, core.version


def whole_model_summary(
    summary: dict[str, Any],
    *,
    core: Any,
    model: nn.Module,
    placement: Placement,
    parts: list[Mapping[str, torch.Tensor]],
    loads: list[pb.ShardLoad],
    test_set: Any,
    summary_path: str | Path,
) -> dict[str, Any]:
    """The end of a sharded run on shard 0 (the real one and the virtual one): the whole model into the final
    checkpoint (:func:`write_whole_final`), evaluated on ``test_set`` (``None``: not), the placement and every
    shard's load into the summary, a ``whole_model`` event; the summary is written again to ``summary_path``."""
    from src.metrics import write_summary
    from src.trainer import evaluate

    system = core.config.system
    checkpoint = write_whole_final(system.checkpoint_dir, model, placement, parts)
    own = pb.ShardLoad()
    own.CopyFrom(loads[0])
    own.rolled_back = core.totals.counters[ROLLED_BACK_HERE]  # shard 0 decides every rollback; these were its own
    asynchronous = system.aggregation_mode == "async"
    loads = [own, *loads[1:]]
    summary = {**summary, "placement": placement.describe(), **shard_loads(placement, loads, asynchronous=asynchronous)}
    if "pipelined_replies" in summary:  # system.pipelined_replies: shard 0's counts, and every follower's
        counts = dict(summary["pipelined_replies"])
        for load in loads[1:]:
            for name in counts:
                counts[name] += getattr(load, name)
        summary["pipelined_replies"] = counts
    if test_set is not None:
        model.load_state_dict(checkpoint["model_state_dict"])
        summary["final_loss"], summary["final_accuracy"] = evaluate(model, test_set)
    core.log.event(
        "whole_model",
        version=checkpoint["step"],
        final_loss=summary["final_loss"],
        final_accuracy=summary["final_accuracy"],
        placement=summary["placement"],
    )
    write_summary(summary_path, summary)
    return summary
