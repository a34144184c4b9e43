"""Streamed pushes (``system.streaming``, issue 34) against unstreamed ones, on real processes.

A streamed worker sends each gradient as backward produces it and takes the reply as it arrives, the next forward
waiting per layer (:mod:`src.ps.worker_stream`). Only when the bytes travel may change: the same runs streamed and not
give the same parameters bit for bit (sync with 2 workers, with and without compression and a compressed downlink; async
with one worker; 2 shards), the same pushes in the events, and every sample once, with faults too. Pipelined replies
(``system.pipelined_replies``, :mod:`src.ps.state.slice_pipeline`) too: the same parameters bit for bit, every slice
confirmed, and a killed worker's round voided.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.coordinator import check_coverage
from src.launch.ps import run_local
from src.metrics import read_events
from src.telemetry.tracing import read_trace
from tests.ps_fixtures import ps_config
from tests.test_ps_equivalence import assert_same_parameters, baseline_parameters

pytestmark = pytest.mark.timeout(240)

TRANSPORTS = ["tcp", "grpc"]


def run(tmp_path: Path, name: str, **fields):
    config = ps_config(tmp_path, name, **fields)
    summary = run_local(config)
    return config, summary, load_checkpoint(summary["checkpoint_path"])["model_state_dict"]


def pushes(config, worker: int) -> list[tuple]:
    """A worker's pushes as its events tell them: batches, verdict, version."""
    path = Path(config.system.log_dir, f"worker_{worker}", "events.jsonl")
    return [(tuple(e["batch_ids"]), e["accepted"], e["version"]) for e in read_events(path, "push")]


def assert_bit_for_bit(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max difference {(actual[name] - value).abs().max()}"


ROLES = ("server", "server_1")
PIPELINED = dict(system__pipelined_replies=True, system__pipeline_slice_bytes=4096)  # several slices a tensor
SYNC = dict(
    system__num_workers=2,
    system__aggregation_mode="sync",
    training__batch_size=16,
    training__max_train_samples=249,
    training__momentum=0.9,
)


@pytest.mark.slow  # per transport: three 2-worker runs and a baseline, ~20 s
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_sync_run_is_the_unstreamed_one_bit_for_bit_and_large_batch_sgd(tmp_path, transport):
    expected = baseline_parameters(tmp_path, batch_size=32, max_train_samples=249, momentum=0.9)
    plain = run(tmp_path, "plain", system__transport=transport, **SYNC)
    streamed = run(tmp_path, "streamed", system__transport=transport, system__streaming=True, **SYNC)
    assert_bit_for_bit(plain[2], streamed[2])
    assert_same_parameters(expected, streamed[2])
    for key in ("versions", "samples_processed"):
        assert streamed[1][key] == plain[1][key]
    for worker in range(2):
        assert pushes(streamed[0], worker) == pushes(plain[0], worker)
    assert check_coverage(read_events(Path(streamed[0].system.log_dir, "server", "events.jsonl")), 249, 1)["ok"]
    # a streamed push costs its parts' framing over the unstreamed one and nothing else, and the reply is the same
    # message (heartbeats, whose count depends on timing, come and go)
    plain_bytes, streamed_bytes = plain[1]["bytes_received"], streamed[1]["bytes_received"]
    assert abs(streamed_bytes - plain_bytes) < 1e-4 * plain_bytes, (streamed_bytes, plain_bytes)
    assert plain[1]["bytes_sent"] < streamed[1]["bytes_sent"] < 1.01 * plain[1]["bytes_sent"]
    # pipelined replies: each slice stepped before the barrier, the same run bit for bit
    pipelined = run(tmp_path, "pipelined", system__transport=transport, system__streaming=True, **PIPELINED, **SYNC)
    assert_bit_for_bit(plain[2], pipelined[2])
    for worker in range(2):
        assert pushes(pipelined[0], worker) == pushes(plain[0], worker)
    events = list(read_events(Path(pipelined[0].system.log_dir, "server", "events.jsonl")))
    assert check_coverage(events, 249, 1)["ok"]
    counts = pipelined[1]["pipelined_replies"]
    # a round sends every slice to both workers, the barrier confirms each, and both replies leave out every parameter
    # (simple_cnn: parameters only); every round does but the first (a worker's first push comes before its
    # connection is known) and, at most, one whose push took a new connection (the bench saw one in 140 rounds)
    rounds = streamed[1]["versions"] - 1
    assert counts["slices_voided"] == 0 and counts["slices_confirmed"] > 0, counts
    assert counts["slices_sent"] == 2 * counts["slices_confirmed"], counts
    per_round = 2 * len(plain[2])
    assert counts["tensors_omitted"] % per_round == 0, counts
    assert (rounds - 1) * per_round <= counts["tensors_omitted"] <= rounds * per_round, counts
    # what the worker received: the slices' frames instead of the parameters' bytes in the replies
    assert abs(pipelined[1]["bytes_received"] - plain_bytes) < 0.01 * plain_bytes


@pytest.mark.slow  # per transport: two 2-worker runs on 2 shards, ~10 s
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_sync_run_on_two_shards_is_the_unstreamed_one_bit_for_bit(tmp_path, transport):
    """Each shard's slices stream to it as its hold while backward goes on (simple_cnn in 64 kB slices: a tensor's
    pieces go to both shards); the commit and the pulls follow as unstreamed. Over TCP with pipelined replies too
    (TCP only with shards: a follower's slices follow its hold's acknowledgement): each shard steps its holds'
    slices as they arrive (a follower for the workers of the last certificate) and sends them on the hold's
    connection; each pull leaves out what its step confirmed. (Streaming without them on shards: over gRPC here,
    and in virtual time, tests/test_virtual_streaming.py.)"""
    fields = dict(SYNC, system__transport=transport, system__num_servers=2, system__shard_slice_bytes=64 << 10)
    plain = run(tmp_path, "plain", **fields)
    pipelining = dict(PIPELINED, system__trace=True) if transport == "tcp" else {}
    streamed = run(tmp_path, "streamed", system__streaming=True, **pipelining, **fields)
    assert any("#" in key for shard in streamed[1]["placement"]["slices_per_shard"] for key in shard)
    assert_bit_for_bit(plain[2], streamed[2])
    for worker in range(2):
        assert pushes(streamed[0], worker) == pushes(plain[0], worker)
    if not pipelining:
        return
    pipelined = streamed
    counts = pipelined[1]["pipelined_replies"]
    # a follower guesses a round's samples from the round before: the last round (249 samples: 13 and 12 against 16
    # and 16) misses, and its slices are voided there; shard 0 knows its rounds and voids nothing
    logs = Path(pipelined[0].system.log_dir)
    voided = {
        role: [e["version"] for e in read_events(logs / role / "events.jsonl", "provisional_voided")]
        for role in ("server", "server_1")
    }
    assert voided == {"server": [], "server_1": [pipelined[1]["versions"]]}, voided
    assert counts["slices_confirmed"] > 0 and counts["slices_voided"] > 0, counts
    assert counts["slices_sent"] == 2 * (counts["slices_confirmed"] + counts["slices_voided"]), counts
    # every round from the second on (the first holds attach the connections, and a follower's first round has no
    # certificate to take its workers from) leaves out every slice's tensor on both shards for both workers
    rounds = pipelined[1]["versions"] - 2
    per_round = 2 * sum(len(shard) for shard in pipelined[1]["placement"]["slices_per_shard"])
    assert counts["tensors_omitted"] >= (rounds - 1) * per_round > 0, counts
    # traced (--trace): the follower's process too, with its holds, pulls and the slices it stepped
    spans = {role: Counter(e.get("name") for e in read_trace(logs / role / "trace.json")) for role in ROLES}
    assert spans["server_1"]["serve_hold"] == 2 * pipelined[1]["versions"], spans
    stepped = sum(spans[role]["provisional"] for role in ("server", "server_1"))
    assert stepped == counts["slices_confirmed"] + counts["slices_voided"] and spans["server_1"]["provisional"], spans


@pytest.mark.slow  # two 2-worker runs, ~10 s
def test_streamed_compression_error_feedback_and_a_compressed_downlink_are_the_unstreamed_ones(tmp_path):
    """Top-k (exact selection: no random numbers) with error feedback, per tensor as each gradient is ready, and
    the reply's top-k deltas added as each arrives: what the unstreamed run computes, bit for bit."""
    fields = dict(
        SYNC,
        system__transport="tcp",
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.1,
        system__topk_selection="exact",
        system__error_feedback=True,
        system__downlink_compression="topk",
        system__downlink_ratio=0.2,
    )
    plain = run(tmp_path, "plain", **fields)
    streamed = run(tmp_path, "streamed", system__streaming=True, **fields)
    assert_bit_for_bit(plain[2], streamed[2])
    for worker in range(2):
        assert pushes(streamed[0], worker) == pushes(plain[0], worker)


@pytest.mark.slow
def test_a_streamed_async_worker_is_the_unstreamed_one_and_sgd(tmp_path):
    fields = dict(
        system__num_workers=1,
        system__aggregation_mode="async",
        system__async_correction="none",
        system__transport="tcp",
        training__batch_size=16,
        training__max_train_samples=100,
        training__momentum=0.9,
    )
    expected = baseline_parameters(tmp_path, batch_size=16, max_train_samples=100, momentum=0.9)
    plain = run(tmp_path, "plain", **fields)
    streamed = run(tmp_path, "streamed", system__streaming=True, **fields)
    assert streamed[1]["versions"] == 7 and streamed[1]["max_staleness"] == 0
    assert_bit_for_bit(plain[2], streamed[2])
    assert_same_parameters(expected, streamed[2])


@pytest.mark.slow
@pytest.mark.alone  # heartbeats and restarts: timing-sensitive
@pytest.mark.timeout(300)
def test_a_streamed_run_survives_a_killed_worker_and_a_killed_server_with_every_sample_once(tmp_path):
    """A worker SIGKILLs itself after its backward, its parts on the wire and the push's message not (the server
    drops the parts with the connection); the server SIGKILLs itself mid-run and the workers' streamed pushes
    find the restarted one. Every sample lands in exactly one applied update, and the run trains. (Sync: what
    follows a fault is the same in async, tests/test_fault_tolerance.py; what streaming adds is how a push is cut
    off, which is the same in both.) With pipelined replies: the slices stepped with the killed worker's parts are
    voided at the barrier that goes on without it, and the surviving worker is sent the step without it."""
    config, summary, _ = run(
        tmp_path,
        "faulty",
        system__num_workers=2,
        system__aggregation_mode="sync",
        system__transport="tcp",
        system__streaming=True,
        **PIPELINED,
        system__heartbeat_interval=0.5,
        system__heartbeat_timeout=3.0,
        system__inject_faults=["kill:worker=1@step=6", "kill:server@version=20"],
        training__num_epochs=2,
        training__batch_size=32,
        training__max_train_samples=1024,
        training__momentum=0.9,
        training__checkpoint_interval=5,
        emulation__step_delay_s=0.1,
        # worker 1 ends its backward after worker 0: the slices are stepped with both workers' parts when it dies
        emulation__workers={1: {"step_delay_s": 0.3}},
    )
    server_events = list(read_events(Path(config.system.log_dir, "server", "events.jsonl")))
    report = check_coverage(server_events, 1024, 2)
    assert report["ok"], report
    voided = [e for e in server_events if e["kind"] == "provisional_voided"]
    # the round that went on without worker 1 (a slice whose gradients were zero on both workers still stands)
    assert voided and all(0 < e["slices"] <= e["stepped"] for e in voided), voided
    assert summary["samples_processed"] == 2 * 1024
    assert summary["faults"]["worker_failures"] >= 1 and summary["faults"]["server_recoveries"] >= 1, summary["faults"]
    assert summary["final_accuracy"] > 0.6, summary["final_accuracy"]
