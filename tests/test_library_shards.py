"""torch_asgc against a sharded server: `connect([shard 0, shard 1])` from a user's own loop trains as against one
server.

Shard 0 is the library's server (:class:`~torch_asgc.server.ClientLoopServer`, a model factory) and shard 1 a
follower (:class:`~src.ps.shards.follower_server.FollowerServer`), each serving on loopback; two worker processes run
a plain loop through :class:`~torch_asgc.model.DistributedModel` and :class:`~torch_asgc.optim.DistributedOptimizer`
with simple_cnn cut into 64 kB slices across the shards. The final checkpoint (the whole model, put together by
shard 0) equals the one-server run's to float32 rounding. A client that gives fewer addresses than the server
has shards is refused with a line that says so, and so is a sharded server without a model factory.
"""

from __future__ import annotations

import pytest
import torch

from src.common.checkpoint import load_checkpoint
from src.config import SetupError
from src.ps.shards.follower_server import FollowerServer
from tests.library_fixtures import TOKEN, LibraryServer, equivalence_worker, library_config, run_worker_processes
from torch_asgc import connect
from torch_asgc.server import main as server_main
from torch_asgc.server import model_from_source

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FACTORY = "tests.library_fixtures:simple_cnn"
FIELDS = dict(
    system__num_workers=2,
    system__aggregation_mode="sync",
    training__batch_size=16,
    training__max_train_samples=249,
    training__num_epochs=1,
    training__momentum=0.9,
    training__dataset="mnist_5k",
)


def _train(server: LibraryServer, addresses, config) -> dict:
    workers = config.system.num_workers
    run_worker_processes(
        equivalence_worker, [(addresses, k, workers, config.to_dict()) for k in range(workers)], timeout=180
    )
    return server.finish()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_library_run_on_two_shards_trains_as_on_one_server(tmp_path, mode):
    """Sync with 2 workers; async with 1 (so that no push is stale, and the order of the pushes is the loop's)."""
    fields = dict(FIELDS, system__aggregation_mode=mode, system__num_workers=2 if mode == "sync" else 1)
    one_config = library_config(tmp_path, "one", **fields)
    with LibraryServer(one_config, model_source=FACTORY) as server:
        one = _train(server, server.address, one_config)

    sharded = dict(fields, system__num_servers=2, system__shard_slice_bytes=64 << 10)
    follower_config = library_config(tmp_path, "two", **sharded)
    follower = FollowerServer(
        follower_config,
        shard=1,
        address="127.0.0.1:0",
        token=TOKEN,
        model=model_from_source(follower_config, FACTORY),
    )
    shard_1 = f"127.0.0.1:{follower.start()}"
    try:
        config = library_config(tmp_path, "two", **sharded, system__shard_addresses=["127.0.0.1:0", shard_1])
        with LibraryServer(config, model_source=FACTORY) as server:
            with pytest.raises(SetupError, match="the server runs 2 shards: connect\\(\\) to every shard"):
                connect(server.address, token=TOKEN, worker_id=0)
            two = _train(server, [server.address, shard_1], config)
    finally:
        follower.stop(grace=0)

    versions = 8 if mode == "sync" else 16  # 249 samples in batches of 16: one push per worker and batch
    assert two["versions"] == one["versions"] == versions
    assert two["samples_processed"] == one["samples_processed"] == 249
    assert len(two["shards"]) == 2 and any(
        "#" in key for key in two["placement"]["slices_per_shard"][0] + two["placement"]["slices_per_shard"][1]
    )
    expected = load_checkpoint(one["checkpoint_path"])["model_state_dict"]
    actual = load_checkpoint(two["checkpoint_path"])["model_state_dict"]
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_sharded_library_server_needs_a_model_factory(capsys):
    with pytest.raises(SystemExit) as exited:
        server_main(["--shard-addresses", "127.0.0.1:1,127.0.0.1:2", "--workers", "2"])
    assert exited.value.code == 2
    assert "--shard-addresses: a sharded server needs --model package.module:function" in capsys.readouterr().err
