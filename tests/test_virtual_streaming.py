"""Virtual time models a streamed parameter-server step (``system.streaming``, issue 34 item 4).

Claims: the pure timeline pieces (:mod:`src.emulation.overlap`) give hand-computed times (a 3-layer model on a slow
link: parts on the link as backward produces them, the next forward waiting per layer); a virtual streamed run's
exposed communication is what the hand computation of its bytes says; it is deterministic; on a slow link it exposes
less communication than the unstreamed virtual run and ends on the same parameters and accuracy (sync: streaming
changes when bytes travel, not what they are).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.config import SetupError
from src.emulation.event_loop import EventLoop, SharedLink
from src.emulation.overlap import FifoLink, ForwardPass, encode_times, ready_offsets, shard_encode_times, split_step
from src.metrics import read_events
from src.training.models import build_model
from src.virtual.calibration import measure_layers
from src.virtual.layers import layer_profile
from src.virtual.run import run_virtual
from tests.ps_fixtures import ps_config

pytestmark = pytest.mark.timeout(120)

COSTS = {"emulation__compute_s": 0.1, "emulation__server_update_s": 0.01, "emulation__server_reply_s": 0.005}


# ----------------------------------------------------------------------------- the pure pieces, by hand


def test_a_step_spreads_over_the_layers_by_weight_and_backward_readies_gradients_in_reverse():
    assert split_step(12.0, [(1, 2), (2, 4), (1, 2)]) == [(1.0, 2.0), (2.0, 4.0), (1.0, 2.0)]
    assert split_step(3.0, [(0, 0), (0, 0)]) == [(0.0, 0.0), (3.0, 0.0)]
    with pytest.raises(ValueError, match=">= 0"):
        split_step(1.0, [(-1, 1)])
    # backward runs layer 2, then 1, then 0: layer 2's gradients at 2 s, layer 1's at 2 + 4, layer 0's at 8;
    # a gradient of no layer (-1) when backward ends
    assert ready_offsets([2.0, 4.0, 2.0], [0, 0, 1, 2, -1]) == [8.0, 8.0, 6.0, 2.0, 8.0]
    # one thread encodes: a part starts when it is ready and the one before it is done
    assert encode_times([1.0, 1.0, 5.0], [0.5, 0.5, 0.5]) == [1.5, 2.0, 5.5]
    # a thread per shard: shard 1's part waits for none of shard 0's; each shard's parts took their seconds in all
    done, busy = shard_encode_times([1.0, 1.0, 1.0, 5.0], [0.5, 0.25, 0.5, 0.5], [0, 1, 0, 0], 3)
    assert (done, busy) == ([1.5, 1.25, 2.0, 5.5], [1.5, 0.25, 0.0])


def test_messages_on_a_fifo_link_go_one_after_another_and_an_idle_link_waits_for_the_next():
    loop = EventLoop()
    link, fifo, out = SharedLink(loop, None), FifoLink(), {}

    def message(name: str, bits: float):
        return lambda free: link.send(bits, 10.0, lambda: (out.setdefault(name, loop.now), free()))

    fifo.put(message("a", 20))  # 2 s at 10 bit/s
    fifo.put(message("b", 10))  # queued behind a: 2 s to 3 s
    loop.at(5.0, lambda: fifo.put(message("c", 10)))  # the link idles from 3 s to 5 s
    loop.run(until=lambda: False)
    assert out == {"a": 2.0, "b": 3.0, "c": 6.0} and not fifo.busy


def test_the_forward_waits_for_a_layer_only_until_its_tensors_arrive():
    loop, ended, waits = EventLoop(), {}, []
    missing = {"w0", "w1", "w2"}
    forward = ForwardPass(
        loop,
        [1.0, 2.0, 1.0],
        [frozenset({"w0"}), frozenset({"w1"}), frozenset({"w2"})],
        missing,
        lambda waited: ended.update(waited=waited, at=loop.now),
        lambda start, end: waits.append((start, end)),
    )

    def arrive(key: str) -> None:
        missing.discard(key)
        forward.arrived()

    loop.at(0.5, lambda: arrive("w0"))  # layer 0 waits 0.5 s, runs to 1.5
    loop.at(1.0, lambda: arrive("w1"))  # in before layer 1 needs it: no wait, runs to 3.5
    loop.at(6.0, lambda: arrive("w2"))  # layer 2 waits 3.5 -> 6, runs to 7
    forward.start()
    loop.run(until=lambda: False)
    assert ended == {"waited": pytest.approx(3.0), "at": 7.0}
    assert forward.finished and forward.waited_s == pytest.approx(3.0) and loop.now == 7.0
    assert waits == [(0.0, 0.5), (3.5, 6.0)]  # each wait, for the trace's parameter_wait spans


def test_a_three_layer_step_on_a_slow_link_exposes_what_the_hand_computation_says():
    """Three layers, forward 1, 2, 1 s and backward 2, 4, 2 s (a 12 s step); gradients of 10, 40 and 20 bits on a
    10 bit/s uplink; the push's message 10 bits; the server answers 1 s after the message is in; the reply (head 10
    bits, then the layers' tensors 10, 40, 20 bits) on a 10 bit/s downlink; the next forward waits per layer.

    By hand: backward from 4 s: layer 2's part ready at 6 (on the link 6-8), layer 1's at 10 (10-14), layer 0's at 12
    (queued: 14-15), the message after backward (12 s) queued behind: 15-16. Exposed uplink: 16 - 12 = 4 s. Server:
    17. Reply: head in at 18, layer 0 at 19, layer 1 at 23, layer 2 at 25. Next forward from 18: layer 0 waits
    18-19, runs 19-20; layer 1 waits 20-23, runs 23-25; layer 2's in at 25: no wait, runs 25-26. Exposed: (18 - 12)
    + 1 + 3 = 10 s; unstreamed it would be: 90 bits up (9 s) + 1 + 90 bits down (9 s) = 19 s.
    """
    loop = EventLoop()
    up, down = SharedLink(loop, None), SharedLink(loop, None)
    uplink, downlink = FifoLink(), FifoLink()
    split = split_step(12.0, [(1, 2), (2, 4), (1, 2)])
    gradient_bits, layer_of = [10, 40, 20], [0, 1, 2]
    order = [2, 1, 0]  # as backward hands them over
    times: dict[str, float] = {}
    missing = {0, 1, 2}

    def send(link: SharedLink, fifo: FifoLink, bits: float, then) -> None:
        fifo.put(lambda free: link.send(bits, 10.0, lambda: (free(), then())))

    def reply() -> None:
        send(down, downlink, 10, lambda: start_next_forward())
        for layer, bits in enumerate(gradient_bits):
            send(down, downlink, bits, lambda layer=layer: arrived(layer))

    def arrived(layer: int) -> None:
        missing.discard(layer)
        times[f"tensor {layer}"] = loop.now
        forward.arrived()

    def start_next_forward() -> None:
        times["head"] = loop.now
        forward.start()

    def backward(_waited: float) -> None:
        start = loop.now
        offsets = ready_offsets([b for _, b in split], layer_of)
        ready = encode_times([start + offsets[g] for g in order], [0.0] * 3)
        for g, at in zip(order, ready):
            loop.at(at, lambda g=g: send(up, uplink, gradient_bits[g], lambda: None))
        computed = start + sum(b for _, b in split)
        times["computed"] = computed
        loop.at(computed, lambda: send(up, uplink, 10, lambda: loop.after(1.0, reply)))

    first = ForwardPass(loop, [f for f, _ in split], [frozenset()] * 3, set(), backward)
    forward = ForwardPass(
        loop, [f for f, _ in split], [frozenset({n}) for n in range(3)], missing, lambda w: times.setdefault("end", w)
    )
    first.start()
    loop.run(until=lambda: False)
    assert times["computed"] == 12.0 and times["head"] == pytest.approx(18.0)
    assert [times[f"tensor {n}"] for n in range(3)] == pytest.approx([19.0, 23.0, 25.0])
    assert forward.waited_s == pytest.approx(4.0) and loop.now == pytest.approx(26.0)
    exposed = times["head"] - times["computed"] + forward.waited_s
    assert exposed == pytest.approx(10.0)


def test_the_layer_proxy_follows_the_forward_and_gives_backward_twice_a_weighted_layer():
    model = build_model("mlp", type("Shape", (), {"channels": 1, "height": 28, "width": 28, "num_classes": 10}))
    before = [p.detach().clone() for p in model.parameters()]
    profile = layer_profile(model, torch.zeros(1, 28, 28), 16)
    assert profile.names == ("1", "3", "5") and profile.layer_of == (0, 0, 1, 1, 2, 2)
    assert profile.needs[1] == frozenset({("parameters", 2), ("parameters", 3)})
    assert profile.param_bytes == (4 * 784 * 256, 4 * 256, 4 * 256 * 128, 4 * 128, 4 * 128 * 10, 4 * 10)
    (f0, b0), (f1, b1), _ = profile.weights
    assert b0 == pytest.approx(f0 + 2 * 16 * 784 * 256 - 2 * 16 * 784 * 256)  # reads the input: no input gradient
    assert b1 - f1 == pytest.approx(2 * 16 * 256 * 128)  # the input's gradient too: twice the multiply-adds
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model is untouched


def test_calibration_measures_each_layers_share_beside_the_proxys(tmp_path):
    config = ps_config(tmp_path, "layers", training__model_architecture="mlp")
    shares = measure_layers(config, steps=3)
    assert shares["layers"] == ["1", "3", "5"] and len(shares["measured"]) == len(shares["proxy"]) == 3
    assert sum(f + b for f, b in shares["measured"]) == pytest.approx(1.0, abs=1e-3)  # a median step's shares
    assert all(f >= 0 and b >= 0 for f, b in shares["measured"])
    assert sum(f + b for f, b in shares["proxy"]) == pytest.approx(1.0, abs=1e-3)


# ----------------------------------------------------------------------------- virtual runs


def streamed_config(tmp_path: Path, name: str, **fields):
    values = {
        "system__clock": "virtual",
        "system__streaming": True,
        "training__max_train_samples": 64,
        "training__batch_size": 16,
        **COSTS,
        **fields,
    }
    return ps_config(tmp_path, name, **values)


def assert_same_run(first: dict, second: dict) -> None:
    """Two summaries of the same virtual run agree in every field but the wall-clock ones."""
    wall = set(first["wall_time_fields"]) | {"checkpoint_path"}
    assert {k: v for k, v in first.items() if k not in wall} == {k: v for k, v in second.items() if k not in wall}


def assert_same_model(ours: dict, theirs: dict) -> None:
    """Two runs' final checkpoints hold the same parameters, bit for bit."""
    mine = load_checkpoint(ours["checkpoint_path"])["model_state_dict"]
    other = load_checkpoint(theirs["checkpoint_path"])["model_state_dict"]
    assert mine.keys() == other.keys() and all(torch.equal(mine[name], other[name]) for name in other)


def pushes(config, worker: int = 0) -> list[dict]:
    return list(read_events(Path(config.system.log_dir) / f"worker_{worker}" / "events.jsonl", "push"))


def test_a_streamed_step_on_a_slow_uplink_exposes_the_last_layers_part_the_message_and_the_server(tmp_path):
    """One worker, mlp (layers of 803 kB, 132 kB and 5 kB), a 40 Mbit/s uplink, the downlink unlimited: the first
    layer's gradients are ready when backward ends (the step's 0.1 s), and the link has carried the others by then
    (the second layer's 132 kB take 26 ms from its gradients at ~60 ms), so each step exposes the first layer's two
    parts and the push's message on the link, then the server's update and reply: nothing of the reply (the downlink
    is not limited)."""
    config = streamed_config(tmp_path, "up", training__model_architecture="mlp", emulation__uplink_mbps=40.0)
    summary = run_virtual(config, tensorboard=False)
    events = pushes(config)
    assert len(events) == 4
    worker = summary["workers"][0]
    first_layer = (4 + 56 + 4 * 784 * 256) + (4 + 56 + 4 * 256)  # each part: its index, the payload's header, floats
    parts = sum(4 + 56 + 4 * n for n in (784 * 256, 256, 256 * 128, 128, 128 * 10, 10))
    expected = 0.0
    for event in events:
        message = event["push_bytes"] - parts  # the push's own fields (its request id, batches, metrics)
        assert 0 < message < 200 and event["payload_bytes"] == parts - 4 * 6
        expected += 8 * (first_layer + message) / 40e6 + 0.01 + 0.005
    assert worker["communication_time_s"] == pytest.approx(expected, abs=1e-6)  # the summary keeps 7 decimals
    assert summary["exposed_communication_s"] == pytest.approx(worker["communication_time_s"])


def test_a_measured_layer_split_replaces_the_proxy_and_a_wrong_one_is_refused_in_one_line(tmp_path):
    """``emulation.layer_split``, as ``scripts/calibrate.py --layers`` measures it: the same run as above, with all of
    backward's compute in the last layer (the first backward runs): every gradient is ready only when backward ends,
    so each step exposes all six parts and the message on the 40 Mbit/s uplink, not the first layer's alone. The
    summary's cost model names the split; a split of the wrong length, or outside a streamed virtual run, is refused in
    one line."""
    split = [[0.5, 0.0], [0.0, 0.0], [0.0, 0.5]]
    config = streamed_config(
        tmp_path, "split", training__model_architecture="mlp", emulation__uplink_mbps=40.0, emulation__layer_split=split
    )
    summary = run_virtual(config, tensorboard=False)
    parts = sum(4 + 56 + 4 * n for n in (784 * 256, 256, 256 * 128, 128, 128 * 10, 10))
    expected = sum(8 * event["push_bytes"] / 40e6 + 0.01 + 0.005 for event in pushes(config))
    assert all(event["push_bytes"] - parts < 200 for event in pushes(config))
    assert summary["workers"][0]["communication_time_s"] == pytest.approx(expected, abs=1e-6)
    assert summary["cost_model"]["layer_split"] == split
    wrong = streamed_config(tmp_path, "wrong", training__model_architecture="mlp", emulation__layer_split=[[1, 1]])
    with pytest.raises(SetupError, match=r"emulation.layer_split has 1 pairs; the model's streamed layers are 3: "):
        run_virtual(wrong, tensorboard=False)
    for fields in ({"system__streaming": False}, {"system__clock": "real"}):  # it has nothing to spread there
        with pytest.raises(ValueError, match=r"^emulation.layer_split: .* modelled in virtual time only"):
            streamed_config(tmp_path, "plain", emulation__layer_split=[[1, 1]] * 3, **fields)
    with pytest.raises(ValueError, match="every share must be a finite number >= 0"):
        streamed_config(tmp_path, "negative", emulation__layer_split=[[1, -1]])


TWO_WORKERS_ON_40_MBPS = {
    "system__num_workers": 2,
    "system__aggregation_mode": "sync",
    "training__max_train_samples": 128,
    "emulation__uplink_mbps": 40.0,
    "emulation__downlink_mbps": 40.0,
}
"""Two sync workers whose links carry 1.7 MB each way a step in 0.34 s, against 0.1 s of compute."""


def test_a_streamed_run_is_deterministic_hides_communication_and_trains_as_the_unstreamed_one(tmp_path):
    fields = TWO_WORKERS_ON_40_MBPS
    streamed = [streamed_config(tmp_path, f"streamed{n}", **fields) for n in range(2)]
    unstreamed = streamed_config(tmp_path, "unstreamed", system__streaming=False, **fields)
    first, second = (run_virtual(c, tensorboard=False) for c in streamed)
    plain = run_virtual(unstreamed, tensorboard=False)
    assert_same_run(first, second)
    assert pushes(streamed[0], 1) == pushes(streamed[1], 1)
    # the same updates, the same parameters: only when bytes travel changed
    assert first["final_accuracy"] == plain["final_accuracy"] and first["final_loss"] == plain["final_loss"]
    assert_same_model(first, plain)
    # 1.7 MB each way at 40 Mbit/s (0.34 s) against 0.1 s of compute: the streamed worker hides some of it
    assert first["exposed_communication_s"] < 0.85 * plain["exposed_communication_s"]
    assert first["train_time_s"] < plain["train_time_s"]
    assert first["samples_processed"] == plain["samples_processed"] == 128
    json.dumps(first)  # the summary is still plain JSON


@pytest.mark.slow
def test_pipelined_replies_train_as_the_unstreamed_run_bit_for_bit_and_hide_more_than_streaming(tmp_path):
    """``system.pipelined_replies`` in virtual time (:mod:`src.virtual.sink`): the same two-worker run on 40 Mbit/s
    links, its slices stepped as the parts' pieces arrive and sent down before the reply, every one confirmed: the
    same parameters as the unstreamed run, bit for bit, and fc1's reply overlapping its push, so less is exposed than
    streamed without pipelining. Deterministic, as every virtual run."""
    fields = TWO_WORKERS_ON_40_MBPS
    pipelined = [streamed_config(tmp_path, f"pipelined{n}", system__pipelined_replies=True, **fields) for n in (0, 1)]
    first, second = (run_virtual(c, tensorboard=False) for c in pipelined)
    streamed = run_virtual(streamed_config(tmp_path, "streamed", **fields), tensorboard=False)
    plain = run_virtual(streamed_config(tmp_path, "unstreamed", system__streaming=False, **fields), tensorboard=False)
    assert_same_run(first, second)
    assert_same_model(first, plain)
    assert first["final_loss"] == plain["final_loss"] and first["versions"] == plain["versions"] == 4
    counts = first["pipelined_replies"]
    # simple_cnn's 8 tensors in 20 slices of 128 kB (fc1's 401,408 values in 13): from the second push on (the first
    # attaches the connection), every slice went to both workers and was confirmed, and each reply left all 8 out
    assert counts == {"slices_sent": 2 * 3 * 20, "slices_confirmed": 3 * 20, "slices_voided": 0, "tensors_omitted": 48}
    assert first["exposed_communication_s"] < 0.85 * streamed["exposed_communication_s"], (first, streamed)
    assert first["train_time_s"] < streamed["train_time_s"]
    # received beyond the unstreamed run: each slice's head (16 bytes), and the switch in each worker's registration
    # reply (sent only when on)
    switch = len('"pipelined_replies":true,')
    assert first["bytes_received"] - plain["bytes_received"] == 16 * counts["slices_sent"] + 2 * switch


@pytest.mark.slow
def test_a_streamed_sharded_run_trains_as_the_unstreamed_one_and_pipelined_replies_hide_more(tmp_path):
    """Two shards (``system.num_servers``): each gradient's slices stream to the shard holding them, on the worker's
    connection to it, as backward produces them; each shard's hold follows its parts, then the commit and the pulls
    (``Worker._train_step_streamed``). The same parameters as the unstreamed sharded run, bit for bit, and less
    exposed; deterministic. With pipelined replies too, every slice confirmed, and much less exposed: the pulls'
    values came down during the holds."""
    fields = {**TWO_WORKERS_ON_40_MBPS, "system__num_servers": 2}
    streamed = [streamed_config(tmp_path, f"sharded{n}", **fields) for n in (0, 1)]
    first, second = (run_virtual(c, tensorboard=False) for c in streamed)
    plain = run_virtual(streamed_config(tmp_path, "plain", system__streaming=False, **fields), tensorboard=False)
    assert_same_run(first, second)
    assert_same_model(first, plain)
    assert first["final_loss"] == plain["final_loss"] and first["versions"] == plain["versions"] == 4
    assert first["placement"] == plain["placement"] and len(first["placement"]["bytes_per_shard"]) == 2
    # the holds go up during backward; the pulls come after the commit, as unstreamed (they are not streamed into
    # the next forward): what is hidden is some of backward's 0.1 s compute a step at most, for each of 8 steps
    hidden = plain["exposed_communication_s"] - first["exposed_communication_s"]
    assert 0.1 < hidden < 8 * 0.1, (first, plain)
    assert first["train_time_s"] < plain["train_time_s"]
    # each shard took the same gradients, as parts: its load counts them
    assert [s["bytes_in"] for s in first["shards"]] == pytest.approx([s["bytes_in"] for s in plain["shards"]], rel=0.02)
    # pipelined replies: each shard steps its holds' slices as they arrive (the follower for the workers of the last
    # certificate) and sends them on the hold's connection; the pull after it leaves out what the step confirmed
    pipelined_config = streamed_config(tmp_path, "pipelined", system__pipelined_replies=True, **fields)
    pipelined = run_virtual(pipelined_config, tensorboard=False)
    assert_same_model(pipelined, plain)
    assert pipelined["final_loss"] == plain["final_loss"] and pipelined["versions"] == 4
    # from the second push on (the first attaches the connections; the follower's first round has no certificate
    # to take its workers from, but the second does), as on one server: 20 slices a round to both workers
    counts = pipelined["pipelined_replies"]
    assert counts == {"slices_sent": 2 * 3 * 20, "slices_confirmed": 3 * 20, "slices_voided": 0, "tensors_omitted": 48}
    assert pipelined["exposed_communication_s"] < 0.75 * first["exposed_communication_s"], (pipelined, first)
    # the slices' bytes: counted as received (their values instead of the pulls', and a 16-byte head each), and as
    # each shard's bytes out
    extra = pipelined["bytes_received"] - plain["bytes_received"]
    assert 0 <= extra - (16 * counts["slices_sent"] + 2 * len('"pipelined_replies":true,')) < 100, extra
    assert (
        sum(s["bytes_out"] for s in pipelined["shards"]) - sum(s["bytes_out"] for s in plain["shards"]) >= extra - 100
    )


def test_faults_with_streaming_are_refused_in_one_line(tmp_path):
    faulted = streamed_config(
        tmp_path, "faults", system__inject_faults=["kill:worker=0@step=2"], emulation__restart_s=1
    )
    with pytest.raises(SetupError, match="system.inject_faults: not with system.streaming"):
        run_virtual(faulted, tensorboard=False)


def test_a_compressed_streamed_run_with_a_compressed_downlink_trains_as_the_unstreamed_one(tmp_path):
    """Top-k with error feedback, per part (``WorkerStep.encode_part``), and a top-k downlink (the reply's
    ``parameter_deltas``, each a parameter's tensor to wait for): the same parameters, less exposed."""
    fields = {
        "system__num_workers": 2,
        "system__aggregation_mode": "sync",
        "training__max_train_samples": 128,
        "system__compression_enabled": True,
        "system__compression_type": "topk",
        "system__compression_ratio": 0.1,
        "system__downlink_compression": "topk",
        "emulation__compress_s": 0.01,
        "emulation__uplink_mbps": 10.0,
        "emulation__downlink_mbps": 10.0,
    }
    streamed = run_virtual(streamed_config(tmp_path, "streamed", **fields), tensorboard=False)
    plain = run_virtual(streamed_config(tmp_path, "plain", system__streaming=False, **fields), tensorboard=False)
    assert_same_model(streamed, plain)
    assert streamed["exposed_communication_s"] < plain["exposed_communication_s"]
    assert streamed["compression_time_s"] == plain["compression_time_s"] > 0  # compress_s per push, as unstreamed
