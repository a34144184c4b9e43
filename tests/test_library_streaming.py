"""torch_asgc with a server that streams (``system.streaming``, issue 34): a user's own loop communicates while it
computes, through :class:`~torch_asgc.optim.DistributedOptimizer` and :class:`~torch_asgc.model.DistributedModel`.

Only when the bytes travel may change: the same loop streamed and not gives the same parameters bit for bit (sync
with 2 worker processes and top-k + error feedback; async with one worker, dense), over TCP and gRPC; and so do the
loops that cannot stream a step as it goes (a stray backward dropped by ``zero_grad()``, a step skipped for
non-finite gradients, gradient accumulation, which turns streaming off with a warning), and a reply that breaks
off after its head (the next forward pulls the parameters). The next forward really
overlaps the reply: with the reply's last tensor held back, ``step()`` returns and the next forward's first layers
run before it is in. A GradScaler is refused in one line.

On a sharded server (2 shards, simple_cnn cut into 64 kB slices) each shard's slices stream to it as its hold and
the commit and pulls follow unstreamed, as our own workers do: the same bit for bit (sync with 2 worker processes and
top-k + error feedback over TCP; async with one worker over TCP and gRPC; one worker in sync through a dropped
backward, a skipped step and gradient accumulation), and a hold that fails is a shard starting again, as for every
worker.

With pipelined replies (dense, sync, one worker, on one server and on 2 shards): the same bit for bit, every round
after the first pipelined (the server guesses a round's samples from the worker's last push) and every slice confirmed.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from src.common.checkpoint import load_checkpoint
from src.config import SetupError
from src.ps.shards.follower_server import FollowerServer
from src.ps.shards.parts import model_placement
from src.ps.state.slice_pipeline import slice_elements_of
from src.training.data import load_dataset
from src.transport.errors import CallError
from tests.library_fixtures import (
    TOKEN,
    LibraryServer,
    library_config,
    plain_loop,
    run_worker_processes,
    shard_batches,
    simple_cnn,
)
from torch_asgc import DistributedModel, DistributedOptimizer, connect
from torch_asgc.server import model_from_source

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["tcp", "grpc"]
SAMPLES = 100
SYNC_TOPK = dict(
    system__num_workers=2,
    system__aggregation_mode="sync",
    system__compression_enabled=True,
    system__compression_type="topk",
    system__compression_ratio=0.05,
    training__batch_size=16,
    training__max_train_samples=249,
    training__num_epochs=1,
    training__momentum=0.9,
    training__dataset="mnist_5k",
)
ASYNC = dict(
    training__dataset="mnist_5k",
    training__max_train_samples=SAMPLES,
    training__momentum=0.9,
    training__batch_size=16,
    system__async_correction="none",
)


@pytest.fixture(scope="module")
def train_set():
    return load_dataset("mnist_5k", "train", max_samples=SAMPLES)


def assert_bit_for_bit(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max difference {(actual[name] - value).abs().max()}"


def final_parameters(summary: dict) -> dict[str, torch.Tensor]:
    return load_checkpoint(summary["checkpoint_path"])["model_state_dict"]


# ------------------------------------------------------------------------------------- sync, 2 worker processes


def streaming_worker(address: str, worker: int, num_workers: int, config_dict: dict) -> None:
    """A worker process: :func:`~tests.library_fixtures.equivalence_worker`'s loop (simple_cnn, our shard order),
    which checks that every step streamed when the server streams."""
    from src.config import validate_config

    torch.set_num_threads(1)
    config = validate_config(config_dict)
    t = config.training
    train_set = load_dataset(t.dataset, "train", max_samples=t.max_train_samples)
    torch.manual_seed(t.seed)
    net = simple_cnn()
    with connect(address, token=TOKEN, worker_id=worker) as client:
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=t.learning_rate, momentum=0.9), client)
        batches = shard_batches(len(train_set), num_workers, worker, 0, t.seed, t.batch_size)
        plain_loop(model, optimizer, train_set, batches)
        assert optimizer.streaming == config.system.streaming
        assert optimizer._generation == (len(batches) if config.system.streaming else 0)


FACTORY = "tests.library_fixtures:simple_cnn"


@contextmanager
def two_shards(tmp_path: Path, name: str, **fields):
    """A library server on 2 shards (shard 0 and a follower, simple_cnn in 64 kB slices): ``(server, addresses)``,
    the addresses naming the transport, shard 0 first."""
    fields = dict(fields, system__num_servers=2, system__shard_slice_bytes=64 << 10)
    follower_config = library_config(tmp_path, name, **fields)
    follower = FollowerServer(
        follower_config, shard=1, address="127.0.0.1:0", token=TOKEN, model=model_from_source(follower_config, FACTORY)
    )
    shard_1 = f"127.0.0.1:{follower.start()}"
    try:
        config = library_config(tmp_path, name, **fields, system__shard_addresses=["127.0.0.1:0", shard_1])
        with LibraryServer(config, model_source=FACTORY) as server:
            yield server, [server.url, f"{server.server.transport}://{shard_1}"]
    finally:
        follower.stop(grace=0)


def sync_run(tmp_path: Path, name: str, *, shards: bool = False, **fields) -> dict:
    config = library_config(tmp_path, name, **SYNC_TOPK, **fields)
    if shards:
        with two_shards(tmp_path, name, **SYNC_TOPK, **fields) as (server, addresses):
            run_worker_processes(streaming_worker, [(addresses, k, 2, config.to_dict()) for k in range(2)], timeout=100)
            return server.finish()
    with LibraryServer(config) as server:
        run_worker_processes(streaming_worker, [(server.url, k, 2, config.to_dict()) for k in range(2)], timeout=100)
        return server.finish()


@pytest.fixture(scope="module")
def sync_unstreamed(tmp_path_factory) -> dict:
    return sync_run(tmp_path_factory.mktemp("sync"), "plain", system__transport="tcp")


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_worker_processes_streaming_with_topk_and_error_feedback_are_the_unstreamed_run_bit_for_bit(
    tmp_path, sync_unstreamed, transport
):
    streamed = sync_run(tmp_path, "streamed", system__transport=transport, system__streaming=True)
    assert_bit_for_bit(final_parameters(sync_unstreamed), final_parameters(streamed))
    for key in ("versions", "samples_processed", "pushes_applied", "steps_skipped"):
        assert streamed[key] == sync_unstreamed[key], key
    assert streamed["versions"] == 8 and streamed["samples_processed"] == 249


# ------------------------------------------------------------------------------------- one worker in this process


@contextmanager
def one_server(tmp_path: Path, name: str, **fields):
    with LibraryServer(library_config(tmp_path, name, **fields)) as server:
        yield server, server.url


def user_loop(
    tmp_path: Path, name: str, train_set, *, transport: str = "tcp", variant=None, shards: bool = False, **fields
):
    """A plain loop of simple_cnn over the first SAMPLES samples in batches of 16 (``variant(step, model, optimizer,
    images, labels)``: the step's forward and backward, done otherwise; ``shards``: on 2 shards); returns the
    worker's final parameters (read through the DistributedModel), the optimizer, the client's totals and the run
    summary."""
    serve = two_shards if shards else one_server
    with serve(tmp_path, name, system__transport=transport, **{**ASYNC, **fields}) as (server, address):
        with connect(address, token=TOKEN) as client:
            torch.manual_seed(0)  # the same initial values in every run
            net = simple_cnn()
            model = DistributedModel(net, client)
            optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), client)
            for step, indices in enumerate(shard_batches(SAMPLES, 1, 0, 0, 0, 16)):
                images, labels = train_set.batch(indices)
                optimizer.zero_grad()
                if variant is None:
                    F.cross_entropy(model(images), labels).backward()
                else:
                    variant(step, model, optimizer, images, labels)
                optimizer.step()
            parameters = {key: value.clone() for key, value in model.state_dict().items()}
            totals = dict(client.totals)
        summary = server.finish()
    return parameters, optimizer, totals, summary


@pytest.fixture(scope="module")
def async_unstreamed(tmp_path_factory, train_set):
    return user_loop(tmp_path_factory.mktemp("async"), "plain", train_set)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_async_user_loop_streaming_is_the_unstreamed_one_bit_for_bit(
    tmp_path, train_set, async_unstreamed, transport
):
    parameters, optimizer, totals, summary = user_loop(
        tmp_path, "streamed", train_set, transport=transport, system__streaming=True
    )
    assert optimizer.streaming and optimizer._generation == 7  # every step streamed
    assert_bit_for_bit(async_unstreamed[0], parameters)
    assert summary["versions"] == async_unstreamed[3]["versions"] == 7
    assert totals["samples"] == SAMPLES and totals["payload_bytes"] == async_unstreamed[2]["payload_bytes"]


def stray_backward_and_a_non_finite_step(step, model, optimizer, images, labels):
    """Step 1: a backward whose gradients zero_grad() drops before the real one; step 3: non-finite gradients
    (skipped)."""
    if step == 1:
        F.cross_entropy(model(images[:4]), labels[:4]).backward()
        optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    (loss * float("inf") if step == 3 else loss).backward()


def test_a_dropped_backward_and_a_skipped_step_stream_as_the_unstreamed_loop_takes_them(tmp_path, train_set):
    """Sync with one worker, top-k + error feedback: the given-up pushes leave the residuals as they were, and the
    skipped step reaches the server as a skip."""
    fields = dict(
        system__aggregation_mode="sync",
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.05,
        variant=stray_backward_and_a_non_finite_step,
    )
    plain = user_loop(tmp_path, "plain", train_set, **fields)
    streamed = user_loop(tmp_path, "streamed", train_set, system__streaming=True, **fields)
    assert_bit_for_bit(plain[0], streamed[0])
    assert streamed[1].streaming and streamed[1]._generation == 8  # 7 steps, and the dropped backward's push
    assert streamed[1].skipped_steps == plain[1].skipped_steps == 1
    assert streamed[3]["steps_skipped"] == plain[3]["steps_skipped"] == 1
    assert streamed[3]["versions"] == plain[3]["versions"] == 6
    assert streamed[2]["payload_bytes"] == plain[2]["payload_bytes"]


def accumulate_two_halves(step, model, optimizer, images, labels):
    for half in (slice(0, 8), slice(8, None)):
        (F.cross_entropy(model(images[half]), labels[half]) / 2).backward()


def test_gradient_accumulation_pushes_the_accumulated_gradient_unstreamed_and_says_so(tmp_path, train_set):
    plain = user_loop(tmp_path, "plain", train_set, variant=accumulate_two_halves)
    with pytest.warns(UserWarning, match="gradient accumulation.*every later push goes unstreamed") as caught:
        streamed = user_loop(tmp_path, "streamed", train_set, system__streaming=True, variant=accumulate_two_halves)
    assert len([w for w in caught if "accumulation" in str(w.message)]) == 1
    assert not streamed[1].streaming and streamed[1]._generation == 1  # only the first step's push was opened
    assert_bit_for_bit(plain[0], streamed[0])


# ------------------------------------------------------------------------------------- the overlap


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_next_forward_starts_before_the_reply_is_all_in(tmp_path, train_set, transport):
    """The reply's last tensor (the output layer's bias, last in forward order) is held back on the client's push
    thread: step() still returns (it waits for the reply's head only), and the next forward's first layer runs
    while that tensor is not in; the forward's last layer waits for it, and then holds the server's value."""
    config = library_config(tmp_path, "overlap", system__transport=transport, system__streaming=True, **ASYNC)
    images, labels = train_set.batch(list(range(16)))
    with LibraryServer(config) as server:
        with connect(server.url, token=TOKEN) as client:
            net = simple_cnn()
            model = DistributedModel(net, client)
            optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), client)
            streamed = model.streamed
            last = len(model.trainable) - 1
            held, release, ran = threading.Event(), threading.Event(), []
            take_of = streamed.on_large

            def on_large(generation):
                take = take_of(generation)

                def slow_take(name, index, view):
                    if name == "parameters" and index == last:
                        held.set()
                        release.wait(30)
                    take(name, index, view)

                return slow_take

            streamed.on_large = on_large
            first_layer, last_module = net.features[0], net.classifier[3]
            first_layer.register_forward_hook(lambda *_: ran.append(("first layer", release.is_set())))
            last_module.register_forward_hook(lambda *_: ran.append(("last layer", release.is_set())))

            F.cross_entropy(model(images), labels).backward()
            ran.clear()
            optimizer.step()  # returns with the head in, the last tensor held back
            assert held.wait(10) and not release.is_set()
            assert model.version == 1 and not model.reply_call.done()
            forward = threading.Thread(target=lambda: model(images))
            forward.start()
            while not ran:
                forward.join(0.01)
            forward.join(0.3)
            assert forward.is_alive() and ran == [("first layer", False)]  # the last layer waits for its tensor
            release.set()
            forward.join(10)
            assert ran == [("first layer", False), ("last layer", True)] and streamed.waited_s > 0
            mine = model.state_dict()[model.parameter_names[last]].clone()
        summary = server.finish()
    assert summary["versions"] == 1
    assert torch.equal(mine, final_parameters(summary)[model.parameter_names[last]])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reply_that_breaks_off_after_its_head_is_pulled_by_the_next_forward(
    tmp_path, train_set, async_unstreamed, transport
):
    """The connection breaks while the third reply's last tensor arrives (its push applied): the next forward
    through the DistributedModel pulls the parameters and computes again; the run is the unstreamed one."""
    broken = []

    def break_third_reply(step, model, optimizer, images, labels):
        if step == 0:
            take_of = model.streamed.on_large

            def on_large(generation):
                take = take_of(generation)

                def breaking(name, index, view):
                    if generation == 3 and name == "parameters" and index == len(model.trainable) - 1:
                        broken.append(generation)
                        raise ConnectionResetError("injected: the connection broke mid-reply")
                    take(name, index, view)

                return breaking

            model.streamed.on_large = on_large
        F.cross_entropy(model(images), labels).backward()

    parameters, optimizer, totals, summary = user_loop(
        tmp_path, "broken", train_set, transport=transport, system__streaming=True, variant=break_third_reply
    )
    assert broken == [3] and optimizer._generation == 7
    assert_bit_for_bit(async_unstreamed[0], parameters)
    assert summary["versions"] == 7 and totals["samples"] == SAMPLES


# ------------------------------------------------------------------------------------- refusals


def test_a_grad_scaler_is_refused_in_one_line(tmp_path, train_set):
    config = library_config(tmp_path, "scaler", system__streaming=True, system__transport="tcp", **ASYNC)
    images, labels = train_set.batch(list(range(16)))
    with LibraryServer(config) as server:
        with connect(server.url, token=TOKEN) as client:
            net = simple_cnn()
            model = DistributedModel(net, client)
            optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), client)
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(F.cross_entropy(model(images), labels)).backward()
            with pytest.raises(SetupError) as refused:
                scaler.step(optimizer)
            assert "\n" not in str(refused.value)
            assert "streams pushes (system.streaming)" in str(refused.value) and "GradScaler" in str(refused.value)


# ------------------------------------------------------------------------------------- a sharded server (2 shards)


@pytest.fixture(scope="module")
def sync_shards_unstreamed(tmp_path_factory) -> dict:
    return sync_run(tmp_path_factory.mktemp("sync-shards"), "plain", shards=True, system__transport="tcp")


@pytest.mark.slow
def test_two_worker_processes_streaming_to_two_shards_are_the_unstreamed_run_bit_for_bit(
    tmp_path, sync_shards_unstreamed
):
    """Top-k + error feedback per slice; each worker process checks that every step streamed."""
    streamed = sync_run(tmp_path, "streamed", shards=True, system__transport="tcp", system__streaming=True)
    assert_bit_for_bit(final_parameters(sync_shards_unstreamed), final_parameters(streamed))
    for key in ("versions", "samples_processed", "pushes_applied", "steps_skipped"):
        assert streamed[key] == sync_shards_unstreamed[key], key
    assert streamed["versions"] == 8 and streamed["samples_processed"] == 249 and len(streamed["shards"]) == 2


@pytest.fixture(scope="module")
def async_shards_unstreamed(tmp_path_factory, train_set):
    return user_loop(tmp_path_factory.mktemp("async-shards"), "plain", train_set, shards=True)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_async_user_loop_streaming_to_two_shards_is_the_unstreamed_one_bit_for_bit(
    tmp_path, train_set, async_shards_unstreamed, transport
):
    parameters, optimizer, totals, summary = user_loop(
        tmp_path, "streamed", train_set, transport=transport, shards=True, system__streaming=True
    )
    assert optimizer.streaming and optimizer._generation == 7  # every step streamed
    assert_bit_for_bit(async_shards_unstreamed[0], parameters)
    assert_bit_for_bit(async_shards_unstreamed[0], final_parameters(summary))  # the shards' model, put together
    assert summary["versions"] == async_shards_unstreamed[3]["versions"] == 7
    assert totals["samples"] == SAMPLES
    assert totals["payload_bytes"] == async_shards_unstreamed[2]["payload_bytes"]


def everything_awkward(step, model, optimizer, images, labels):
    """Step 1: a backward that zero_grad() drops; step 3: non-finite gradients (skipped); step 5: two backwards
    (gradient accumulation: streaming stops)."""
    if step == 5:
        accumulate_two_halves(step, model, optimizer, images, labels)
    else:
        stray_backward_and_a_non_finite_step(step, model, optimizer, images, labels)


def test_a_dropped_backward_a_skipped_step_and_accumulation_stream_to_two_shards_as_unstreamed(tmp_path, train_set):
    """Sync with one worker, top-k + error feedback per slice: the given-up pushes leave every slice's residual as it
    was, the skip reaches shard 0 as a skip, the accumulated step goes unstreamed (one warning)."""
    fields = dict(
        system__aggregation_mode="sync",
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.05,
        shards=True,
        variant=everything_awkward,
    )
    plain = user_loop(tmp_path, "plain", train_set, **fields)
    with pytest.warns(UserWarning, match="gradient accumulation.*every later push goes unstreamed"):
        streamed = user_loop(tmp_path, "streamed", train_set, system__streaming=True, **fields)
    assert_bit_for_bit(plain[0], streamed[0])
    assert not streamed[1].streaming and streamed[1]._generation == 7  # steps 0-5 and the dropped backward's push
    assert streamed[1].skipped_steps == plain[1].skipped_steps == 1
    assert streamed[3]["steps_skipped"] == plain[3]["steps_skipped"] == 1
    assert streamed[3]["versions"] == plain[3]["versions"] == 6
    assert streamed[2]["payload_bytes"] == plain[2]["payload_bytes"]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hold_that_fails_is_a_shard_starting_again_streamed_or_not(tmp_path, train_set, streaming):
    """Shard 1 refuses the second step's hold (injected, not retried). The client does what every worker's step
    machine does when a shard fails a call (the shards are starting again): it registers again with shard 0, whose
    registration says the push was not applied, settles the push as lost (its samples are the user's: not redone)
    and pulls every shard; step() returns and the loop goes on, with no call of the push left running."""
    refusal = CallError("FAILED_PRECONDITION", "injected: shard 1 refused the hold")
    with two_shards(tmp_path, "refused", system__transport="tcp", system__streaming=streaming, **ASYNC) as (
        server,
        addresses,
    ):
        with connect(addresses, token=TOKEN) as client:
            net = simple_cnn()
            model = DistributedModel(net, client)
            optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), client)
            shard_1, method = client.shard_transports[0], "_attempt_streamed" if streaming else "push"
            incarnation = client.incarnation

            def refuse(stream_or_request, *args, **kwargs):
                if streaming:
                    list(stream_or_request.parts())  # take every part, as a server would before refusing
                raise refusal

            for step, indices in enumerate(shard_batches(64, 1, 0, 0, 0, 16)):
                images, labels = train_set.batch(indices)
                optimizer.zero_grad()
                if step == 1:  # before the backward, which opens the streamed push
                    setattr(shard_1, method, refuse)
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                if step == 1:
                    delattr(shard_1, method)  # the transport's own again
                    assert all(call.done() for call in client.connections.stream_calls)
                    assert client.membership.last_failure == "lost" and client.incarnation > incarnation
            assert optimizer.steps == 4 and client.totals["steps"] == 3 and model.version == 3
        summary = server.finish()
    assert summary["versions"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("shards", [False, True])
def test_a_sync_user_loop_with_pipelined_replies_is_the_unstreamed_one_bit_for_bit(tmp_path, train_set, shards):
    """Dense gradients, one worker in sync over TCP, on one server and on 2 shards: each server steps the push's (the
    hold's) slices as they arrive and sends them back on its connection; each reply leaves out what its step
    confirmed, and the client fills it in from them. The workers' loops choose their batches, so a server guesses a
    round's samples from each worker's last push: every round but the first (nothing pushed yet) is pipelined."""
    fields = dict(system__aggregation_mode="sync", shards=shards)
    plain = user_loop(tmp_path, "plain", train_set, **fields)
    pipelined = user_loop(
        tmp_path,
        "pipelined",
        train_set,
        system__streaming=True,
        system__pipelined_replies=True,
        system__pipeline_slice_bytes=16 << 10,
        **fields,
    )
    assert pipelined[1].streaming and pipelined[1]._generation == 7
    assert_bit_for_bit(plain[0], pipelined[0])
    assert_bit_for_bit(plain[0], final_parameters(pipelined[3]))
    assert pipelined[3]["versions"] == plain[3]["versions"] == 7
    net, elements = simple_cnn(), slice_elements_of(16 << 10)
    if shards:
        placement = model_placement(net, 2, 64 << 10)
        tensors = [piece.numel for k in range(2) for piece in placement.on_shard(k)]
    else:
        tensors = [param.numel() for param in net.parameters()]
    rounds = pipelined[3]["versions"] - 1
    slices = sum(math.ceil(numel / elements) for numel in tensors)
    assert pipelined[3]["pipelined_replies"] == {
        "slices_sent": rounds * slices,  # one worker: each slice to it once
        "slices_confirmed": rounds * slices,
        "slices_voided": 0,
        "tensors_omitted": rounds * len(tensors),
    }
