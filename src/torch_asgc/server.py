"""A parameter server for any model and any training loop: the workers own the data, the loop and the loss.

:class:`ClientLoopServer` is our :class:`~src.parameter_server.ParameterServer` (gRPC or TCP; same auth, TLS,
sync and async modes, staleness policy, compression, downlink, checkpoints, events and summary) with
two differences:

* **The model** comes from the first worker that sends Initialize (``model_source="client"``: its
  parameter layout and initial values; the other workers pull those), or from a
  ``"package.module:function"`` the user names, called with no arguments after
  ``torch.manual_seed(training.seed)``. The server's optimizer is the config's
  (``training.optimizer``, ``learning_rate``, ``momentum``, ``weight_decay``).
* **The work** is the workers': the server plans no batches and loads no dataset. A reply's Work is
  empty ("train on your next batch"); a push lists no batch ids and says how many samples its
  gradient covers (the sync average is weighted by them). In sync mode each version's barrier
  waits for every worker that is live and has pulled when the round opens; a worker that registers
  later joins the next round; a worker that leaves (``Finish``, i.e. ``WorkerClient.close()``) or
  fails is dropped from the barrier. A push with no gradients and ``num_samples`` 0 is a *skipped*
  step (an AMP overflow): the barrier goes on without it for this version.

With ``system.streaming`` (``--streaming``) the workers' pushes stream (:mod:`torch_asgc.optim`, Streaming): the
server takes each gradient as it arrives and sends the reply buffers first, then the parameters in forward order,
as for our own streamed workers; the updates are the same.

The run ends when every one of the ``system.num_workers`` worker ids has registered and none is
live any more (all finished, or failed); then :meth:`finalize` writes the final checkpoint (whose
``model_state_dict`` keys are the user's own parameter names) and the summary. There is no
server-side evaluation: the server has neither the data nor, for a worker's model, its forward pass.

From the command line (``python -m torch_asgc.server --help``)::

    export DTS_AUTH_TOKEN=$(openssl rand -hex 24)
    python -m torch_asgc.server --server-address 0.0.0.0:50051 --workers 2 --aggregation-mode sync \\
        --learning-rate 0.05 --momentum 0.9
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.config import Config, SetupError
from src.parameter_server import ParameterServer
from src.ps.server.work_source import ClientWork
from src.ps.state.model_sources import import_factory
from src.ps.state.refusals import RunFailed

logger = logging.getLogger(__name__)

CLIENT_MODEL = "client"
"""``model_source`` for a model whose layout and initial values come from the first worker."""


def model_from_source(config: Config, model_source: str) -> nn.Module | None:
    """The model ``model_source`` names: ``None`` for ``"client"``, else the factory's module (seeded).

    Raises:
        SetupError: the factory cannot be imported or does not return an ``nn.Module``.
    """
    if model_source == CLIENT_MODEL:
        return None
    try:
        factory = import_factory(model_source)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    torch.manual_seed(config.training.seed)
    built = factory()
    if not isinstance(built, nn.Module):
        raise SetupError(f"model factory {model_source!r} returned {type(built).__name__}, not an nn.Module")
    return built.float()


class ClientLoopServer(ParameterServer):
    """A parameter server whose workers run their own training loop on their own data (see the module docstring).

    The service of :class:`~src.parameter_server.ParameterServer` over the same core, with the
    workers' own loops as its work source (:class:`~src.ps.server.work_source.ClientWork`) and no evaluation.

    Args:
        config: the run's config: ``system`` (workers, mode, compression, heartbeats, outputs, TLS) and
            the optimizer fields of ``training`` (plus ``seed`` and ``checkpoint_interval``).
        model_source: ``"client"`` (the first worker's model) or ``"package.module:function"``.
        max_message_bytes: the message limit while the model's size is not known yet.
        **kwargs: as for :class:`~src.parameter_server.ParameterServer` (``token``, ``resume``,
            ``tensorboard``, ``staleness_policy``, ``model``, ...).

    Raises:
        SetupError: the factory cannot be imported or does not return an ``nn.Module``.
    """

    def __init__(
        self,
        config: Config,
        *,
        model_source: str = CLIENT_MODEL,
        max_message_bytes: int | None = None,
        model: nn.Module | None = None,
        **kwargs: Any,
    ):
        self.model_source = model_source
        served = model if model is not None else model_from_source(config, model_source)
        super().__init__(
            config,
            model=served,
            serve_without_model=True,
            evaluate=False,
            work=ClientWork(config.system.num_workers),
            model_label=model_source,
            data_label="client",
            max_message_bytes=max_message_bytes,
            **kwargs,
        )

    def fresh_model(self) -> nn.Module:
        """A new instance of the served model: the factory's (a worker's model has no factory here)."""
        return model_from_source(self.config, self.model_source)


# ----------------------------------------------------------------------------- command line

FLAGS = {
    "workers": "system.num_workers",
    "shard_addresses": "system.shard_addresses",
    "aggregation_mode": "system.aggregation_mode",
    "server_address": "system.server_address",
    "transport": "system.transport",
    "tls_cert": "system.tls_cert_file",
    "tls_key": "system.tls_key_file",
    "weight_decay": "training.weight_decay",
    "heartbeat_interval": "system.heartbeat_interval",
    "heartbeat_timeout": "system.heartbeat_timeout",
    "downlink_compression": "system.downlink_compression",
    "downlink_ratio": "system.downlink_ratio",
    "streaming": "system.streaming",
    "pipelined_replies": "system.pipelined_replies",
}
DEFAULTS = {
    "system.checkpoint_dir": "checkpoints/asgc_server",
    "system.log_dir": "logs/asgc_server",
    "system.server_address": "127.0.0.1:50051",
    "training.checkpoint_interval": 100,
}


def build_parser() -> argparse.ArgumentParser:
    from src.launch.cli import add_compression_flags, add_config_flags, add_observability_flags

    parser = argparse.ArgumentParser(
        prog="python -m torch_asgc.server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML or JSON config file (flags override its values)")
    add_config_flags(parser)
    add_observability_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--server-address", help="host:port to listen on (default 127.0.0.1:50051; port 0: a free port)")
    run.add_argument(
        "--transport",
        choices=("grpc", "tcp"),
        help="grpc (default) or tcp (binary frames; workers connect('tcp://host:port'))",
    )
    run.add_argument(
        "--streaming",
        action="store_const",
        const=True,
        help="workers communicate while they compute: each gradient is sent as backward produces it, and the next "
        "forward starts as its first layers' parameters arrive (same updates; docs/library.md, Streaming)",
    )
    run.add_argument(
        "--pipelined-replies",
        action="store_const",
        const=True,
        help="with --streaming, sync, dense gradients (shards: --transport tcp): each slice of a parameter is stepped "
        "as soon as every worker's gradient of it is in and sent back during the push; the barrier's step confirms "
        "it. The workers' loops pick their batches, so a round's samples are guessed from each worker's last push "
        "(same updates; docs/library.md, Streaming)",
    )
    run.add_argument("--workers", type=int, help="worker ids 0..N-1 (default 2); sync starts when all N have pulled")
    run.add_argument(
        "--aggregation-mode", choices=("sync", "async"), help="barrier per version, or apply each push (default sync)"
    )
    run.add_argument(
        "--model",
        dest="model_source",
        default=CLIENT_MODEL,
        help="'client' (the first worker's model, default) or 'package.module:function' building it",
    )
    run.add_argument("--seed", type=int, help="torch seed before calling a model factory (default 0)")
    run.add_argument(
        "--shard-addresses",
        "--shards",
        dest="shard_addresses",
        type=lambda text: [address for address in text.split(",") if address],
        help="A,B,...: a server split across shards (sync, a --model factory): every shard's host:port, shard 0 "
        "first; this process serves --shard K and binds its entry unless --server-address says otherwise; "
        "workers connect([A, B, ...])",
    )
    run.add_argument("--shard", type=int, default=0, help="this process's shard, 0..N-1 (default 0)")
    optimizer = parser.add_argument_group("server optimizer")
    optimizer.add_argument("--optimizer", choices=("sgd", "adam"), help="default sgd")
    optimizer.add_argument("--learning-rate", type=float, help="default 0.05")
    optimizer.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    optimizer.add_argument("--weight-decay", type=float, help="default 0")
    add_compression_flags(parser, "compression the workers use unless their DistributedOptimizer says otherwise")
    downlink = parser.add_argument_group("downlink compression (push replies)")
    downlink.add_argument(
        "--downlink-compression", choices=("none", "topk", "quantization"), help="default none (dense)"
    )
    downlink.add_argument(
        "--downlink-ratio", type=float, help="fraction of entries a top-k downlink delta keeps (default 0.1)"
    )
    health = parser.add_argument_group("membership")
    health.add_argument("--heartbeat-interval", type=float, help="seconds between a worker's heartbeats (default 1)")
    health.add_argument("--heartbeat-timeout", type=float, help="silence after which a worker is failed (default 5)")
    outputs = parser.add_argument_group("outputs and security")
    outputs.add_argument("--checkpoint-interval", type=int, help="server versions between checkpoints (default 100)")
    outputs.add_argument("--checkpoint-dir", help="default checkpoints/asgc_server")
    outputs.add_argument("--log-dir", help="events.jsonl, TensorBoard and summary.json (default logs/asgc_server)")
    outputs.add_argument("--summary-json", help="run summary path (default <log-dir>/summary.json)")
    outputs.add_argument("--resume", help="continue from this server checkpoint (file or folder)")
    outputs.add_argument("--tls-cert", help="server certificate (PEM); with --tls-key the server speaks TLS")
    outputs.add_argument("--tls-key", help="server private key (PEM)")
    return parser


def serve(
    config: Config,
    *,
    model_source: str = CLIENT_MODEL,
    token: str | None = None,
    resume: str | Path | None = None,
    summary_json: str | Path | None = None,
) -> dict[str, Any]:
    """Serve one run until every worker has left; returns the run summary (also written to disk).

    Args:
        token: the auth token (default: ``system.auth_token`` or ``$DTS_AUTH_TOKEN``).
    """
    from src.telemetry import tracing

    server = ClientLoopServer(config, model_source=model_source, token=token, resume=resume)
    with tracing.trace_to(
        Path(config.system.log_dir) / "server" / tracing.TRACE_FILE, "parameter server", enabled=config.system.trace
    ):
        try:
            port = server.start()
            host = config.system.server_address.rpartition(":")[0]
            logger.info(
                "parameter server listening on %s:%d (%s, %d workers, model: %s)",
                host,
                port,
                config.system.aggregation_mode,
                config.system.num_workers,
                model_source,
            )
            server.wait_until_done()
            return server.finalize(summary_json)
        finally:
            server.stop()


def serve_follower(config: Config, shard: int, *, model_source: str, token: str | None = None) -> Path:
    """Serve follower shard ``shard`` of a sharded run (``system.shard_addresses``) until shard 0 has ended the
    run; returns where its part of the model was written."""
    from src.launch.ps_roles import run_follower, wait_for_run_end

    model = model_from_source(config, model_source)
    if model is None:
        raise SetupError("a sharded server needs --model package.module:function (a worker's model is not sharded)")
    return run_follower(
        config,
        shard,
        address=config.system.server_address,
        token=token,
        wait=lambda over: wait_for_run_end(config, over),
        model=model,
    )


def summary_lines(summary: dict[str, Any]) -> str:
    """What the server prints at the end (no accuracy: the workers evaluate, on their own data)."""
    return "\n".join(
        [
            f"Versions: {summary['versions']}  Samples: {summary['samples_processed']:,}  "
            f"Pushes applied: {summary['pushes_applied']}  rejected: {summary['pushes_rejected']}  "
            f"skipped steps: {summary['steps_skipped']}",
            f"Total Time: {summary['total_time_s']:.2f}s",
            f"Throughput: {summary['throughput_samples_per_s']:.1f} samples/s",
            f"Bytes Sent: {summary['bytes_sent']:,}  Bytes Received: {summary['bytes_received']:,}",
            f"Checkpoint: {summary['checkpoint_path']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from src.launch.cli import COMPRESSION_FLAGS, config_from_args, exit_status
    from src.transport.settings import AuthTokenMissing

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shard_addresses:
        if not 0 <= args.shard < len(args.shard_addresses):
            parser.error(f"--shard {args.shard}: one of 0..{len(args.shard_addresses) - 1} (--shard-addresses)")
        if args.server_address is None:
            args.server_address = args.shard_addresses[args.shard]
        if args.model_source == CLIENT_MODEL:
            parser.error("--shard-addresses: a sharded server needs --model package.module:function")
    elif args.shard:
        parser.error("--shard is for a server split across shards: give --shard-addresses")
    config = config_from_args(
        args,
        defaults=DEFAULTS,
        extra_flags={**FLAGS, **COMPRESSION_FLAGS},
        forced={"system.architecture": "parameter_server"},
    )

    def run() -> None:
        if args.shard:
            path = serve_follower(config, args.shard, model_source=args.model_source)
            print(f"parameter-server shard {args.shard}: the run is over; its part of the model is in {path}")
            return
        summary = serve(config, model_source=args.model_source, resume=args.resume, summary_json=args.summary_json)
        print(summary_lines(summary))

    return exit_status(
        run, describe={AuthTokenMissing: str, RunFailed: str}, interrupted="interrupted: stopped the parameter server"
    )


if __name__ == "__main__":
    sys.exit(main())
