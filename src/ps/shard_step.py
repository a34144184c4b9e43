"""The messages of a worker's step on a sharded server, built alike by every driver of a worker.

The real worker (:mod:`src.worker`), the library's client (:mod:`src.torch_asgc.client`) and the simulated worker
(:mod:`src.virtual.worker`) take a step on a sharded server in three calls (sync: :mod:`src.ps.shard_rounds`;
async: :mod:`src.ps.shard_async`): hold the slices on every shard, commit to shard 0, pull every shard. What they
send is built here, once:

* :func:`holds`: the push's hold to each shard, each based on the version of that shard's slices the worker
  holds (sync: all the same; async: each shard's own, which is what the shard's staleness is counted from);
* :func:`commit`: the tensor-free commit to shard 0, which in async carries the followers' staleness;
* :func:`shards_apart`: whether the slices the pulls brought can be trained on together;
* :func:`applied_on`: whether a shard applied the push (its residuals are committed) or rolled it back.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Sequence

from src import parameter_server_pb2 as pb


def holds(request: pb.PushRequest, versions: Sequence[int]) -> list[pb.PushRequest]:
    """``request``'s hold to each shard (``hold``; the tensors go with the call), based on ``versions[k]``, the
    version of shard ``k``'s slices the worker computed on."""
    held = []
    for version in versions:
        message = pb.PushRequest()
        message.CopyFrom(request)
        message.hold = True
        message.base_version = version
        held.append(message)
    return held


def commit(request: pb.PushRequest, acks: Sequence[pb.PushReply], base_version: int, mode: str) -> pb.PushRequest:
    """The commit of ``request`` to shard 0 (based on ``base_version``, its slices' version) once every shard has
    acknowledged its hold (``acks``, in shard order); ``mode`` async: with each follower's staleness."""
    message = pb.PushRequest()
    message.CopyFrom(request)
    message.commit = True
    message.base_version = base_version
    if mode == "async":
        for shard, ack in enumerate(acks[1:], start=1):
            message.shard_staleness.add(shard=shard, staleness=ack.staleness)
    return message


def shards_apart(versions: Sequence[int], version: int, mode: str) -> bool:
    """Whether slices at ``versions`` (shard order) cannot be trained on together after shard 0 answered at
    ``version``: sync, every shard must be at that version; async, none may be behind it (a follower's pull applies
    every version up to it; a shard started again from an older checkpoint is)."""
    if mode == "async":
        return any(v < version for v in versions)
    return any(v != version for v in versions)


def applied_on(reply: pb.PushReply, shard: int) -> bool:
    """Whether shard ``shard`` applied the push that ``reply`` (shard 0's commit reply) answers: it was accepted, and
    not rolled back there (async: a shard where its staleness was over the bound rolls its slices back, and the
    worker rolls back their residuals, while the others apply theirs: :mod:`src.ps.shard_async`)."""
    return reply.accepted and shard not in reply.rolled_back
