"""The worker's step machine alone (src/ps/worker/machine.py), with scripted replies, as the server core is tested.

Claim: every protocol decision of a worker's step is the machine's, and each is checked here without a server, a
clock or a socket: what it sends (one server's push; a sharded server's holds, each based on its shard's version, the
commit with the followers' staleness, the pulls with the certificate), how a reply settles (committed, rolled back
and carried, rolled back on one shard only), what a failed call means (a lost session, a revoked incarnation, a
shard starting again, a refusal), finishing, and a server that needs the model. Drivers only carry the calls
(tests/test_ps_training.py, tests/test_virtual_time.py, tests/test_torch_asgc/ run the same machine for real).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from src import parameter_server_pb2 as pb
from src.compression import TopKCompressor
from src.compressors.policy import CompressionPolicy
from src.metrics import MetricsLogger, read_events
from src.ps.shards.placement import layout_of, place
from src.ps.worker import Membership, PushCodec, Rejoined, Rejoins, StepFigures, StepMachine
from src.ps.worker.calls import FINISH, INITIALIZE, PULL, PUSH, REGISTER, Call, run_callbacks
from src.ps.worker.codec import all_finite, named_gradients
from src.ps.worker.membership import IncarnationRevoked
from src.transport.errors import CallError
from src.transport.wire import Outgoing, Received, serialize, split, tensor_view

SYNC = SimpleNamespace(aggregation_mode="sync", staleness_policy="none")
ASYNC = SimpleNamespace(aggregation_mode="async", staleness_policy="hard")
FIGURES = StepFigures(0.1, 0.01, 0.2, 100, 120, 130, 1000, 2000)
NAMES = ["w", "b"]


def _tensors() -> list[torch.Tensor]:
    return [torch.zeros(4, 3), torch.zeros(3)]


def _reply(kind, values: list[torch.Tensor] | None = None, **fields) -> Received:
    """A reply as a transport hands it over: its message, and views of its tensors' bytes."""
    large = {"parameters": [tensor_view(v) for v in values or []], "buffers": []}
    data = serialize(Outgoing(kind(**fields), large))
    return split(data, kind, ("parameters", "buffers") + (("parameter_deltas",) if kind is pb.PushReply else ()))


def _registration(**fields) -> pb.RegisterReply:
    return pb.RegisterReply(worker_id=1, incarnation=fields.pop("incarnation", 2), session=b"s2", **fields)


def _machine(system=SYNC, *, shards: int = 1, policy=None, planned=True, log=None, rejoins=2) -> StepMachine:
    membership = Membership(1, Rejoins(1, rejoins))
    membership.registration = pb.RegisterReply(worker_id=1, incarnation=1, session=b"s1")
    membership.caller = pb.Caller(worker_id=1, session=b"s1")
    params = _tensors()
    placement = place(layout_of(list(zip(NAMES, params))), shards, slice_bytes=16) if shards > 1 else None
    codec = PushCodec(system, policy, error_feedback=True, seed=0, worker_id=1, names=NAMES, placement=placement)
    stats = lambda: pb.WorkerStats(samples=5, steps=1)  # noqa: E731
    return StepMachine(
        membership, system, names=NAMES, params=params, buffer_names=[], buffers=[], placement=placement,
        codec=codec, planned_work=planned, log=log, stats=stats,
    )  # fmt: skip


def drive(exchange, answer: Callable[[list[Call]], list[Any]]) -> tuple[Any, list[list[Call]]]:
    """Run ``exchange`` to its outcome, each round's calls answered by ``answer``; the outcome and every round."""
    rounds, replies = [], None
    while True:
        try:
            calls = exchange.send(replies)
        except StopIteration as stop:
            return stop.value, rounds
        rounds.append(calls)
        replies = answer(calls)


def _gradients(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((4, 3), scale)), ("b", torch.arange(3.0) * scale)]


BATCHES = [pb.Batch(batch_id=7, epoch=0, indices=[0, 1, 2])]


def test_one_servers_push_settles_on_its_reply_and_loads_its_parameters():
    machine = _machine()
    payloads = machine.encode(_gradients())
    request = machine.request(BATCHES, loss=2.0, correct=1)
    new = [torch.ones(4, 3), torch.ones(3)]
    reply, rounds = drive(
        machine.push(request, payloads, []),
        lambda calls: [_reply(pb.PushReply, new, accepted=True, version=1)],
    )
    [[call]] = rounds
    assert (call.shard, call.method, call.message.caller.session) == (0, PUSH, b"s1")
    assert call.tensors["gradients"] == payloads[0] and call.message.batch_ids == [7]
    assert machine.settle(reply, FIGURES) and machine.version == 1
    assert all(torch.equal(p, v) for p, v in zip(machine.params, new))
    assert machine.totals["steps"] == 1 and machine.totals["samples"] == 3 and machine.carried == []
    assert machine.totals["train_loss"] == 2.0 and machine.last_communication_s == 0.2


def test_a_rejected_push_rolls_back_into_the_residual_and_its_batches_go_with_the_next():
    machine = _machine(ASYNC)
    machine.request(BATCHES, loss=1.0)
    machine.encode(_gradients())
    machine.settle(_reply(pb.PushReply, _tensors(), accepted=False, version=0), FIGURES)
    assert torch.equal(machine.codec.feedback.residual("w"), torch.ones(4, 3))  # no gradient mass lost
    assert machine.carried == BATCHES and machine.totals["pushes_rejected"] == 1
    later = [pb.Batch(batch_id=8, epoch=0, indices=[3])]
    request = machine.request(later)
    assert list(request.batch_ids) == [7, 8] and request.num_samples == 4


def test_a_sharded_push_holds_on_every_shard_commits_with_the_followers_staleness_then_pulls(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    machine = _machine(ASYNC, shards=2, log=log)
    machine.shard_versions[:] = [5, 4]
    machine.version = 5
    payloads = machine.encode(_gradients())
    request = machine.request(BATCHES, loss=1.0)
    slices = [[torch.ones(piece.numel) for piece in machine.placement.on_shard(k)] for k in range(2)]
    script = iter(
        [
            lambda calls: [_reply(pb.PushReply, accepted=True), _reply(pb.PushReply, accepted=True, staleness=1)],
            lambda calls: [_reply(pb.PushReply, accepted=True, version=6, certificate=b"cert", rolled_back=[1])],
            lambda calls: [_reply(pb.PullReply, slices[k], version=6) for k in range(2)],
        ]
    )
    reply, rounds = drive(machine.push(request, payloads, []), lambda calls: next(script)(calls))
    holds, [commit], pulls = rounds
    assert [h.message.base_version for h in holds] == [5, 4] and all(h.message.hold for h in holds)
    assert [h.tensors["gradients"] for h in holds] == payloads
    assert commit.message.commit and commit.message.base_version == 5 and not commit.tensors
    assert [(s.shard, s.staleness) for s in commit.message.shard_staleness] == [(1, 1)]
    assert [p.message.certificate for p in pulls] == [b"", b"cert"] and all(p.message.parameters_only for p in pulls)
    assert machine.shard_versions == [6, 6] and torch.equal(machine.params[0], torch.ones(4, 3))
    machine.settle(reply, FIGURES)  # applied on shard 0, rolled back on shard 1: its slices' residuals only
    feedback = machine.codec.feedback
    assert all(feedback.residual(p.key) is None or not feedback.residual(p.key).any() for p in holds_slices(machine, 0))
    assert all(torch.count_nonzero(feedback.residual(p.key)) for p in holds_slices(machine, 1) if p.name == "w")
    log.close()  # the worker's push event names the shards that rolled the push back
    [push] = read_events(tmp_path / "events.jsonl", "push")
    assert push["accepted"] and push["rolled_back"] == [1]


def holds_slices(machine: StepMachine, shard: int):
    return machine.placement.on_shard(shard)


def test_a_lost_session_registers_again_and_settles_the_push_by_the_registration():
    for applied, planned, residual in ((True, True, 0.0), (False, True, 0.0), (False, False, 1.0)):
        machine = _machine(ASYNC, planned=planned)
        machine.request(BATCHES)
        request = machine.request(BATCHES)
        payloads = machine.encode(_gradients())
        machine.carried = [pb.Batch(batch_id=3, indices=[9])]
        script = iter(
            [
                lambda calls: [CallError("UNAVAILABLE", "the server is starting again")],
                lambda calls: [_registration(last_request_applied=applied)],
                lambda calls: [_reply(pb.PullReply, _tensors(), version=9)],
            ]
        )
        outcome, rounds = drive(machine.push(request, payloads, []), lambda calls: next(script)(calls))
        [push], [register], [pull] = rounds
        assert register.method == REGISTER and register.message.last_request_id == request.request_id
        assert list(register.message.carried_batch_ids) == [3]  # a lost session: its carried batches stay its own
        assert pull.method == PULL and pull.message.caller.session == b"s2"  # the new session from here on
        assert isinstance(outcome, Rejoined) and machine.version == 9 and machine.membership.last_failure == "lost"
        # applied: committed; not, on planned work: discarded (its samples are handed out again); the user's own
        # loop: rolled back into the residual (its samples are not redone)
        left = machine.codec.feedback.residual("w")
        assert (0.0 if left is None else float(left.max())) == residual
        assert machine.carried == ([] if applied else [pb.Batch(batch_id=3, indices=[9])])
        assert machine.totals["steps"] == 0  # a lost push is not a step


def test_a_revoked_incarnation_rejoins_within_its_budget_and_then_stops():
    machine = _machine(ASYNC, rejoins=1)
    machine.carried = BATCHES
    request = machine.request()
    machine.encode(_gradients())
    script = iter(
        [
            lambda calls: [CallError("ABORTED", "worker 1 incarnation 1 was declared failed")],
            lambda calls: [_registration()],
            lambda calls: [_reply(pb.PullReply, _tensors(), version=3)],
        ]
    )
    outcome, rounds = drive(machine.push(request, [[]], []), lambda calls: next(script)(calls))
    assert list(rounds[1][0].message.carried_batch_ids) == []  # its batches went to the live workers
    assert isinstance(outcome, Rejoined) and machine.carried == [] and machine.membership.last_failure == "revoked"
    assert machine.stats(bytes_sent=0, bytes_received=0, total_time_s=1.0).samples == -5  # the old incarnation's off
    request = machine.request()
    machine.encode(_gradients())
    with pytest.raises(IncarnationRevoked, match="max_rejoins=1"):
        drive(machine.push(request, [[]], []), lambda calls: [CallError("ABORTED", "failed again")])


def test_a_refusal_is_raised_and_a_shard_that_fails_is_a_shard_starting_again():
    machine = _machine(ASYNC)
    with pytest.raises(CallError, match="bad push"):
        drive(machine.push(machine.request(), [[]], []), lambda calls: [CallError("INVALID_ARGUMENT", "bad push")])
    sharded = _machine(ASYNC, shards=2)
    request = sharded.request()
    payloads = sharded.encode(_gradients())
    script = iter(
        [
            lambda calls: [_reply(pb.PushReply, accepted=True), CallError("FAILED_PRECONDITION", "shard 1: behind")],
            lambda calls: [_registration()],
            lambda calls: [_reply(pb.PullReply, [torch.zeros(p.numel) for p in sharded.placement.on_shard(0)])],
            lambda calls: [_reply(pb.PullReply, [torch.zeros(p.numel) for p in sharded.placement.on_shard(1)])],
        ]
    )
    outcome, rounds = drive(sharded.push(request, payloads, []), lambda calls: next(script)(calls))
    assert [c.method for c in rounds[1]] == [REGISTER] and isinstance(outcome, Rejoined)
    assert sharded.membership.last_failure == "lost"


def test_shards_that_answer_at_different_versions_make_the_worker_register_again():
    machine = _machine(SYNC, shards=2)
    slices = [[torch.zeros(p.numel) for p in machine.placement.on_shard(k)] for k in range(2)]
    script = iter(
        [
            lambda calls: [_reply(pb.PullReply, slices[0], version=4)],
            lambda calls: [_reply(pb.PullReply, slices[1], version=3)],  # shard 1 is starting again
            lambda calls: [_registration()],
            lambda calls: [_reply(pb.PullReply, slices[0], version=4)],
            lambda calls: [_reply(pb.PullReply, slices[1], version=4)],
        ]
    )
    received, rounds = drive(machine.pull_everything(), lambda calls: next(script)(calls))
    assert [c[0].method for c in rounds] == [PULL, PULL, REGISTER, PULL, PULL] and machine.shard_versions == [4, 4]


def test_finish_after_a_failure_pulls_on_planned_work_and_finishes_again_on_the_users_own():
    for planned in (True, False):
        machine = _machine(planned=planned)
        script = iter(
            [
                lambda calls: [CallError("NOT_FOUND", "unknown session")],
                lambda calls: [_registration()],
                lambda calls: [_reply(pb.PullReply, _tensors(), version=2) if planned else pb.FinishReply()],
            ]
        )
        outcome, rounds = drive(machine.finish(lambda: pb.WorkerStats(steps=4)), lambda calls: next(script)(calls))
        assert [c[0].method for c in rounds] == [FINISH, REGISTER, PULL if planned else FINISH]
        assert isinstance(outcome, Rejoined) if planned else outcome is None and machine.finished_stats.steps == 4


def test_a_server_started_again_without_a_model_is_offered_it_when_the_worker_registers_again():
    machine = _machine(planned=False)
    script = iter(
        [
            lambda calls: [CallError("UNAVAILABLE", "down")],
            lambda calls: [_registration(model_wanted=True)],
            lambda calls: [pb.InitializeReply(accepted=True)],
            lambda calls: [_reply(pb.PullReply, _tensors(), version=0)],
        ]
    )
    _, rounds = drive(machine.pull_everything(), lambda calls: next(script)(calls))
    [offer] = rounds[2]
    assert offer.method == INITIALIZE and [s.name for s in offer.message.parameter_specs] == NAMES


def test_a_sync_skip_tells_the_barrier_to_go_on_held_on_shard_0_then_committed():
    machine = _machine(SYNC, shards=2)
    slices = [[torch.zeros(p.numel) for p in machine.placement.on_shard(k)] for k in range(2)]
    script = iter(
        [
            lambda calls: [_reply(pb.PushReply, accepted=True)],
            lambda calls: [_reply(pb.PushReply, accepted=True, version=1, certificate=b"c")],
            lambda calls: [_reply(pb.PullReply, slices[k], version=1) for k in range(2)],
        ]
    )
    _, rounds = drive(machine.skip(), lambda calls: next(script)(calls))
    [hold], [commit], pulls = rounds
    assert hold.shard == 0 and hold.message.hold and hold.message.num_samples == 0 and commit.message.commit
    assert len(pulls) == 2 and machine.totals["steps_skipped"] == 1 and machine.version == 1


def test_a_streamed_sharded_commit_reports_every_holds_encoding_seconds():
    machine = _machine(SYNC, shards=2)
    request = machine.request(BATCHES)
    exchange = machine.push(request, [], [], streamed=True)
    holds = exchange.send(None)
    assert all(call.streamed for call in holds)
    for call, seconds in zip(holds, (0.25, 0.5)):  # what each driver measured of its stream's parts
        call.message.metrics.compression_time_s = seconds
    [commit] = exchange.send([_reply(pb.PushReply, accepted=True) for _ in holds])
    assert not commit.streamed and commit.message.metrics.compression_time_s == 0.75


def test_the_controllers_active_fraction_applies_from_the_next_push_and_is_an_event(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        machine = _machine(policy=CompressionPolicy(TopKCompressor(ratio=0.5)), log=log)
        machine.request(BATCHES)
        machine.encode(_gradients())
        reply = _reply(pb.PushReply, _tensors(), accepted=True, version=1, control=pb.Control(compression_ratio=0.25))
        machine.settle(reply, FIGURES)
    assert machine.codec.policy.compressor.ratio == 0.25
    [event] = read_events(tmp_path / "events.jsonl", "control_applied")
    assert (event["step"], event["compression_ratio"], event["previous_compression_ratio"]) == (2, 0.25, 0.5)
    [push] = read_events(tmp_path / "events.jsonl", "push")
    assert push["batch_ids"] == [7] and push["push_bytes"] == 120 and push["version"] == 1


def test_the_first_pull_is_the_run_start_and_a_steps_figures_count_its_calls_bytes(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        machine = _machine(log=log)
        received, rounds = drive(machine.start("here:1"), lambda calls: [_reply(pb.PullReply, _tensors(), version=3)])
    assert [call.method for [call] in rounds] == [PULL] and received.message.version == machine.version == 3
    [event] = read_events(tmp_path / "events.jsonl", "run_start")
    assert (event["address"], event["incarnation"], event["version"]) == ("here:1", machine.membership.incarnation, 3)
    figures = StepFigures.of((0.1, 0.01, 0.2), 100, [(70, 30), (50, 100)], (1000, 2000))
    assert figures == FIGURES


def test_an_exchange_carried_by_callbacks_goes_round_by_round_and_hands_what_it_raises_on():
    machine, sent, outcomes, errors, held = _machine(), [], [], [], []

    def message(call: Call) -> Callable:
        sent.append(call.method)  # made now; sent when the driver says
        return lambda reply: reply(_reply(pb.PullReply, _tensors(), version=4))

    run_callbacks(machine.pull_everything(), message, outcomes.append, start=held.append)
    assert sent == [PULL] and outcomes == []
    held[0]()
    assert outcomes[0].message.version == machine.version == 4
    refused = lambda call: lambda reply: reply(CallError("PERMISSION_DENIED", "no"))  # noqa: E731
    run_callbacks(machine.pull_everything(), refused, outcomes.append, failed=errors.append)
    assert len(outcomes) == 1 and errors[0].code == "PERMISSION_DENIED"


def test_the_codec_gives_each_slices_share_of_its_tensor_and_a_users_gradients_unscaled_zeros_for_none():
    codec = _machine(shards=2).codec
    shares = codec.shares_of(NAMES, [12, 3])
    assert [[(k, position) for k, position, _ in parts] for parts in shares] == codec.slices_of(NAMES)
    assert [sum(share for _, _, share in parts) for parts in shares] == pytest.approx([1.0, 1.0])
    trainable = [("w", torch.zeros(2)), ("b", torch.zeros(1))]
    named = named_gradients(trainable, [torch.full((2,), 4.0), None], torch.tensor(2.0))
    assert [n for n, _ in named] == ["w", "b"] and torch.equal(named[0][1], torch.full((2,), 2.0))
    assert torch.equal(named[1][1], torch.zeros(1))
    assert all_finite([None, torch.ones(2)]) and not all_finite([torch.tensor([float("inf")])])
    assert all_finite([]) and not all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("inf"), float("-inf")])])  # their sum is NaN, still refused
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows: the exact check decides
    assert all_finite([big, big.to(torch.bfloat16)])
    assert not all_finite([torch.cat([big, torch.tensor([-float("inf")])])])


def test_a_workers_codec_takes_the_runs_error_feedback_unless_told_and_the_compression_it_is_given():
    plain = PushCodec.of_worker(SimpleNamespace(**vars(SYNC), error_feedback=True), 0, 1, NAMES, compression="none")
    assert plain.policy is None and plain.feedback is None  # identity payloads in sync: nothing to feed back
    topk = PushCodec.of_worker(SYNC, 0, 1, NAMES, compression=TopKCompressor(ratio=0.5), error_feedback=True)
    assert topk.policy.compressor.ratio == 0.5 and topk.feedback is not None


def test_a_worker_given_another_number_of_shard_addresses_is_told_how_many_in_one_line():
    from src.config import SetupError
    from src.ps.worker.run_config import check_shard_addresses

    check_shard_addresses(2, 2, "list in system.shard_addresses")  # every shard: nothing to say
    for given, counted in ((0, "got 0 addresses"), (1, "got 1 address)"), (3, "got 3 addresses")):
        with pytest.raises(SetupError, match=r"the server runs 2 shards: connect\(\) to every shard's") as refused:
            check_shard_addresses(2, given, "connect() to")
        assert counted in str(refused.value) and "\n" not in str(refused.value)
