"""torch_asgc surfaces, fast: client, DistributedModel, DistributedOptimizer, AMP, plugins.

A real :class:`ClientLoopServer` serves on a loopback port in this process; the "workers" are the
test's own loops (threads where two must run at once). Runs alone: ``pytest tests/test_torch_asgc/test_library.py``.
The plugin tests import Lightning and transformers (seconds of imports), so they are marked slow.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from src.compression import build_compressor
from src.compressors.policy import CompressionPolicy
from src.config import SetupError
from src.ps.state.model_sources import import_factory, model_from_layout
from src.ps.state.staleness import StalenessPolicy
from src.transport.errors import CallError
from tests.library_fixtures import TOKEN, LibraryServer, TinyConvNet, library_config, small_mlp
from tests.ps_fixtures import transport  # noqa: F401  (fixture: each transport)
from torch_asgc import DistributedModel, DistributedOptimizer, connect
from torch_asgc.server import ClientLoopServer

pytestmark = pytest.mark.timeout(60)


def data(count: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 1, 28, 28, generator=generator)
    return images, (images.flatten(1)[:, :10].sum(1) > 0).long()


def steps(model, optimizer, images, labels, batch_size: int = 32, **step_kwargs) -> None:
    for start in range(0, len(images), batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(images[start : start + batch_size]), labels[start : start + batch_size]).backward()
        optimizer.step(**step_kwargs)


@pytest.fixture
def served(tmp_path):
    servers = []

    def serve(**fields) -> LibraryServer:
        kwargs = {k: fields.pop(k) for k in ("staleness_policy", "model_source") if k in fields}
        servers.append(LibraryServer(library_config(tmp_path, f"run{len(servers)}", **fields), **kwargs))
        return servers[-1]

    yield serve
    for server in servers:
        server.close()


# ----------------------------------------------------------------------------- client


def test_connect_needs_the_right_token(served, monkeypatch, transport):
    server = served(system__transport=transport)
    monkeypatch.delenv("DTS_AUTH_TOKEN", raising=False)
    with pytest.raises(SetupError, match="no auth token"):
        connect(server.url)
    with pytest.raises(CallError) as refused:
        connect(server.url, token="wrong", connect_timeout_s=10)
    assert refused.value.code == "UNAUTHENTICATED"


def test_connect_names_a_bad_transport():
    with pytest.raises(SetupError, match="unknown transport 'udp'"):
        connect("udp://127.0.0.1:1", token=TOKEN)
    with pytest.raises(SetupError, match="names transport 'tcp', but transport='grpc'"):
        connect("tcp://127.0.0.1:1", token=TOKEN, transport="grpc")


def test_server_assigns_free_worker_ids_and_close_leaves_the_run(served):
    server = served(system__num_workers=2)
    first, second = connect(server.address, token=TOKEN), connect(server.address, token=TOKEN)
    assert (first.worker_id, second.worker_id) == (0, 1)
    with pytest.raises(CallError) as full:
        connect(server.address, token=TOKEN, connect_timeout_s=10)
    assert full.value.code == "RESOURCE_EXHAUSTED"
    with first:
        assert first.mode == "async" and first.config.system.num_workers == 2
    second.close()
    second.close()  # idempotent
    assert [m.state for m in server.server.members.current.values()] == ["finished", "finished"]
    assert server.server.wait_until_done(10)  # every id registered and none live: the run is over


# ----------------------------------------------------------------------------- DistributedModel


def test_first_workers_model_is_the_servers_and_others_pull_it(served, transport):
    server = served(system__num_workers=2, system__transport=transport)
    with connect(server.url, token=TOKEN) as a, connect(server.address, token=TOKEN, transport=transport) as b:
        net_a, net_b = small_mlp(seed=1), small_mlp(seed=2)
        expected = {k: v.clone() for k, v in net_a.state_dict().items()}
        assert a.registration.model_wanted
        DistributedModel(net_a, a)
        model_b = DistributedModel(net_b, b)
        for name, value in expected.items():
            assert torch.equal(net_b.state_dict()[name], value), name
        assert list(model_b.state_dict()) == list(expected)  # no "module." prefix
        assert server.server.param_specs[0].name == "1.weight"


def test_a_model_that_does_not_match_is_refused(served):
    server = served(system__num_workers=2)
    with connect(server.address, token=TOKEN) as a, connect(server.address, token=TOKEN) as b:
        DistributedModel(small_mlp(hidden=64), a)
        with pytest.raises(SetupError, match="not match the server's: parameter 0 is 1.weight \\[32, 784\\]"):
            DistributedModel(small_mlp(hidden=32), b)


def test_model_counts_training_samples_only(served):
    server = served()
    with connect(server.address, token=TOKEN) as client:
        model = DistributedModel(small_mlp(), client)
        images, _ = data(40)
        model(images[:25])
        model.module(images[:10])  # the module itself counts too: the hook is on it
        with torch.no_grad():
            model(images)
        model.eval()
        model(images)
        assert model.take_samples() == 35 and model.take_samples() == 0


def test_model_layout_rebuilds_names_and_order():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(3))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.normalize = Inner()  # buffers only, before any parameter
            self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
            self.scale = nn.Parameter(torch.ones(1))

    net = Net()
    params = [(n, tuple(p.shape)) for n, p in net.named_parameters()]
    buffers = [(n, tuple(b.shape)) for n, b in net.named_buffers() if b.is_floating_point()]
    rebuilt = model_from_layout(
        params,
        buffers,
        [p for _, p in net.named_parameters()],
        [b for _, b in net.named_buffers() if b.is_floating_point()],
    )
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in params]
    assert [n for n, _ in rebuilt.named_buffers()] == [n for n, _ in buffers]
    with pytest.raises(ValueError, match="12 bytes, expected 16"):
        model_from_layout([("w", (4,))], [], [b"\0" * 12], [])
    with pytest.raises(ValueError, match="NaN or Inf"):
        model_from_layout([("w", (1,))], [], [torch.tensor([float("nan")])], [])
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        import_factory("no_colon")


def test_factory_model_source(tmp_path):
    config = library_config(tmp_path, training__seed=3)
    server = ClientLoopServer(config, token=TOKEN, tensorboard=False, model_source="tests.library_fixtures:TinyConvNet")
    try:
        torch.manual_seed(3)
        expected = list(TinyConvNet().named_parameters())
        assert [s.name for s in server.param_specs] == [n for n, _ in expected]
        assert torch.equal(server.state.params[0], expected[0][1])
    finally:
        server.stop(grace=0)
    with pytest.raises(SetupError, match="cannot import"):
        ClientLoopServer(config, token=TOKEN, tensorboard=False, model_source="no_such_module:f")


# ----------------------------------------------------------------------------- DistributedOptimizer


@pytest.mark.parametrize("downlink", ["none", "topk"])
def test_async_single_worker_steps_like_local_sgd(served, downlink):
    # downlink top-k at ratio 1: replies carry the parameters as exact deltas, added on the worker
    # async_correction none: the plain server optimizer (the default lookahead sends its lookahead point,
    # which one worker's local SGD does not reach)
    server = served(
        training__learning_rate=0.1,
        training__momentum=0.9,
        system__downlink_compression=downlink,
        system__downlink_ratio=1.0,
        system__async_correction="none",
    )
    images, labels = data()
    reference = small_mlp(seed=5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    steps(reference, reference_optimizer, images, labels)
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp(seed=5)
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), client)
        steps(model, optimizer, images, labels)
        assert model.version == 3 and client.totals["samples"] == 96
    for (name, expected), (_, actual) in zip(reference.named_parameters(), net.named_parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert server.server.downlink.deltas == (3 if downlink == "topk" else 0)
    summary = server.finish()
    assert summary["samples_processed"] == 96 and summary["versions"] == 3 and summary["dataset"] == "client"


def test_wrapped_optimizer_that_differs_is_named_in_a_warning(served):
    server = served()
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp()
        DistributedModel(net, client)
        with pytest.warns(UserWarning, match=r"lr 0.3 \(server: 0.05\)"):
            DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.3), client)


def test_topk_error_feedback_sends_less_and_keeps_the_rest(served):
    server = served()
    images, labels = data()
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp()
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05), client, compression=build_compressor("topk", ratio=0.05)
        )
        steps(model, optimizer, images[:32], labels[:32])
        gradient = net[1].weight.grad.clone()  # the pushed gradient = what was sent + the residual
        residual = optimizer.feedback.residual("1.weight")
        sent = torch.count_nonzero(gradient - residual)
        assert sent == -(-gradient.numel() * 5 // 100)  # top-k kept exactly k entries
        assert client.totals["payload_bytes"] < 0.15 * client.totals["dense_bytes"]
        saved = optimizer.state_dict()
        assert torch.equal(saved["error_feedback"]["residuals"]["1.weight"], residual)
        optimizer.feedback.reset()
        optimizer.load_state_dict(saved)
        assert torch.equal(optimizer.feedback.residual("1.weight"), residual) and optimizer.steps == 1


def test_library_optimizer_pushes_the_bytes_the_ps_worker_step_encodes(served):
    """One implementation of a step: for the same config, worker id and gradients, DistributedOptimizer
    sends the payloads a PS worker's codec, built from the server's config as the worker builds it, encodes
    (quantization's stochastic rounding included) and keeps the same residuals."""
    from src.compressors.policy import policy_from_config
    from src.ps.worker import PushCodec

    server = served(
        system__compression_enabled=True,
        system__compression_type="quantization",
        system__quantization_bits=2,
        system__quantization_bucket_size=64,
    )
    generator = torch.Generator().manual_seed(3)
    with connect(server.address, token=TOKEN) as client:
        net, twin = small_mlp(), small_mlp()
        DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client)
        sent = []
        push = client.transport.push
        client.transport.push = lambda request, payloads=(), buffers=(), **options: (
            sent.append(list(payloads)),
            push(request, payloads, buffers, **options),
        )[1]
        system = client.config.system
        names = [name for name, _ in twin.named_parameters()]
        codec = PushCodec(
            system,
            policy_from_config(system),
            error_feedback=system.error_feedback,
            seed=client.config.training.seed,
            worker_id=client.worker_id,
            names=names,
        )
        for index in range(2):
            for p, q in zip(net.parameters(), twin.parameters()):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = p.grad.clone()
            optimizer.step(num_samples=1)
            assert codec.encode([(n, q.grad) for n, q in twin.named_parameters()], index)[0] == sent[-1]
            codec.settle(0, accepted=True)
        assert len(sent) == 2 and client.totals["pushes_rejected"] == 0
        for name in names:
            assert torch.equal(codec.feedback.residual(name), optimizer.feedback.residual(name))


def test_rejected_push_rolls_back_and_keeps_the_parameters(served):
    class RejectAll(StalenessPolicy):
        def verdict(self, tau: int) -> tuple[float | None, str]:
            return None, f"staleness {tau}: this test rejects every push"

    server = served(system__staleness_policy="hard", staleness_policy=RejectAll("hard"))
    images, labels = data(32)
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp()
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client, compression="none")
        before = [p.clone() for p in net.parameters()]
        steps(model, optimizer, images, labels)
        gradient = net[1].weight.grad.clone()
        assert client.totals["pushes_rejected"] == 1 and model.version == 0
        # the whole gradient waits in the residual for the next push: no gradient mass lost
        assert torch.equal(optimizer.feedback.residual("1.weight"), gradient)
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_sync_two_workers_average_by_samples(served, transport):
    server = served(
        system__num_workers=2, system__aggregation_mode="sync", training__learning_rate=0.1, system__transport=transport
    )
    images, labels = data(48)
    reference = small_mlp(seed=7)
    F.cross_entropy(reference(images), labels).backward()  # one large batch of 48 = 32 + 16
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in reference.parameters()]
    nets = [small_mlp(seed=7), small_mlp(seed=7)]
    parts = [(images[:32], labels[:32]), (images[32:], labels[32:])]
    errors = []

    def worker(k: int) -> None:
        try:
            with connect(server.url, token=TOKEN, worker_id=k) as client:
                model = DistributedModel(nets[k], client)
                optimizer = DistributedOptimizer(
                    torch.optim.SGD(nets[k].parameters(), lr=0.1), client, compression="none"
                )
                steps(model, optimizer, *parts[k], batch_size=32)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    for net in nets:
        for value, want in zip(net.parameters(), expected):
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- AMP


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_amp_overflow_skips_the_step_and_pushes_nothing(served, mode):
    server = served(system__aggregation_mode=mode, training__learning_rate=0.1)
    images, labels = data(32)
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp()
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), client, compression="none")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # float16 backward overflows at this scale
        before = [p.clone() for p in net.parameters()]
        sent_before = client.transport.bytes_sent
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert optimizer.skipped_steps == 1 and model.version == 0 and scaler.get_scale() == 2.0**23
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        assert client.transport.bytes_sent - sent_before < 200  # no gradient on the wire (sync: a skip message)
        assert server.server.counters["pushes_applied"] == 0

        # a scaled step that does not overflow pushes the unscaled gradient: as the fp32 step would
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        expected = [p - 0.1 * p.grad / 1024.0 for p in net.parameters()]
        scaler.step(optimizer)
        scaler.update()
        assert model.version == 1
        for value, want in zip(net.parameters(), expected):
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-7)


def test_nan_gradient_without_scaler_is_skipped(served):
    server = served()
    with connect(server.address, token=TOKEN) as client:
        net = small_mlp()
        model = DistributedModel(net, client)
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client)
        for p in net.parameters():
            p.grad = torch.full_like(p, float("nan"))
        model.add_samples(8)
        optimizer.step()
        assert optimizer.skipped_steps == 1 and model.version == 0


# ----------------------------------------------------------------------------- plugins (imports take seconds)


@pytest.mark.slow
def test_lightning_strategy_surface():
    pl = pytest.importorskip("pytorch_lightning", reason="pip install -e .[lightning]")
    from torch_asgc.plugins.lightning import ASGCStrategy

    strategy = ASGCStrategy("127.0.0.1:1", token=TOKEN, worker_id=0)
    assert isinstance(strategy, pl.strategies.SingleDeviceStrategy) and strategy.client is None
    assert strategy.strategy_name == "asgc"


@pytest.mark.slow
def test_huggingface_callback_surface():
    transformers = pytest.importorskip("transformers", reason="pip install -e .[huggingface]")
    from torch_asgc.plugins.huggingface import ASGCHFTrainerCallback

    callback = ASGCHFTrainerCallback("127.0.0.1:1", token=TOKEN)
    assert isinstance(callback, transformers.TrainerCallback) and callback.client is None
    with pytest.raises(ValueError, match="accelerate-prepared optimizer"):
        callback.on_train_begin(None, None, None, model=nn.Linear(1, 1), optimizer=None)


def test_server_that_plans_its_own_work_is_named(tmp_path):
    from src.trainer import model_from_config
    from tests.ps_fixtures import TOKEN as PS_TOKEN
    from tests.ps_fixtures import ServedServer, ps_config

    config = ps_config(tmp_path)
    served = ServedServer(config, evaluate=False)
    try:
        client = connect(served.address, token=PS_TOKEN)
        with pytest.raises(SetupError, match="python -m torch_asgc.server"):
            DistributedModel(model_from_config(config), client)
        with pytest.raises(CallError, match="the run is not finished"):
            client.close()  # that server's run is not over; close() still stops heartbeats and the channel
    finally:
        served.close()


def test_lost_push_settles_by_whether_it_was_applied_and_redone():
    from src.compressors.error_feedback import ErrorFeedback
    from src.ps.worker.codec import encode_gradients, settle_lost_push

    policy = CompressionPolicy(build_compressor("topk", ratio=0.25))
    gradient = torch.arange(8.0)
    outcomes = {}
    for case in ("applied", "redone", "kept"):
        feedback = ErrorFeedback()
        encode_gradients([("w", gradient)], policy, feedback, None, 0)
        settle_lost_push(feedback, ["w"], applied=case == "applied", redone=case == "redone")
        outcomes[case] = feedback.residual("w")
    assert torch.equal(outcomes["applied"], torch.tensor([0, 1, 2, 3, 4, 5, 0, 0.0]))  # what top-k left out
    assert outcomes["redone"] is None  # its samples come again: as if never computed
    assert torch.equal(outcomes["kept"], gradient)  # not redone: all of it goes with the next push


def test_server_cli_names_bad_input(tmp_path, monkeypatch, capsys):
    from torch_asgc.server import main

    monkeypatch.setenv("DTS_AUTH_TOKEN", TOKEN)
    outputs = [
        "--server-address",
        "127.0.0.1:0",
        "--log-dir",
        str(tmp_path / "logs"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    assert main(["--model", "no_such_module:build", *outputs]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("error: model factory 'no_such_module:build': cannot import no_such_module")
    )
    with pytest.raises(SystemExit) as bad_config:
        main(["--workers", "0", *outputs])
    assert bad_config.value.code == 2
    assert "config error: system.num_workers: must be > 0, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unstreamed:
        main(["--pipelined-replies", *outputs])  # the flag reaches the config, which names what it needs
    assert unstreamed.value.code == 2
    assert "config error: system.pipelined_replies: needs system.streaming" in capsys.readouterr().err
