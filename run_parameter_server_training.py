"""Parameter-server training: a server holds the model, N workers push gradients and pull parameters (gRPC or TCP).

One machine (the server and the workers as processes, random auth token per run):

    python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2
    python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 2
    python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2 \\
        --aggregation-mode async --compression-enabled --compression-type topk --compression-ratio 0.1
    python run_parameter_server_training.py --config configs/ps_sync_mnist.yaml --dataset mnist_5k

The binary TCP transport instead of gRPC (same protocol, auth, TLS and results; fewer copies):

    python run_parameter_server_training.py --workers 2 --dataset mnist --transport tcp

Several hosts (same token everywhere, from $DTS_AUTH_TOKEN or system.auth_token; the same --transport):

    host A$ python run_parameter_server_training.py --role server --server-address 0.0.0.0:50051 --workers 2 ...
    host B$ python run_parameter_server_training.py --role worker --worker-id 0 --server-address A:50051
    host C$ python run_parameter_server_training.py --role worker --worker-id 1 --server-address A:50051

The server decides the run (dataset, model, epochs, batch size, mode, compression); a worker takes
only its local settings (--data-dir, --device, --log-dir, TLS files) from its own flags.

Virtual time (one process, the same job on a simulated clock from a cost model: deterministic,
and 64 workers fit on 2 cores; figures from scripts/calibrate.py):

    python run_parameter_server_training.py --clock virtual --workers 16 --aggregation-mode async \
        --compute-s 0.02 --server-update-s 0.002 --server-reply-s 0.001 --uplink-mbps 250 --slow-worker 1=4

Outputs: the final summary on the terminal, checkpoints/ps_cli/parameter_server_final.pt (the common
checkpoint format), logs/ps_cli/summary.json, and events.jsonl + TensorBoard logs under
logs/ps_cli/server and logs/ps_cli/worker_<k> (change with --checkpoint-dir / --log-dir); with
--artifacts-dir DIR also DIR/ps.json, DIR/worker_metrics.json and DIR/ps_events.jsonl for
generate_performance_report.py.
"""

from __future__ import annotations

import argparse
import sys

from src.config import Config
from src.launch.cli import (
    AMP_FLAGS,
    COMPRESSION_FLAGS,
    EMULATION_FLAGS,
    FAULT_TOLERANCE_FLAGS,
    STALENESS_FLAGS,
    VIRTUAL_FLAGS,
    add_amp_flag,
    add_common_flags,
    add_compression_flags,
    add_emulation_flags,
    add_fault_tolerance_flags,
    add_staleness_flags,
    add_virtual_flags,
    config_from_args,
    exit_status,
    write_artifacts_if_asked,
)
from src.metrics import format_summary

DEFAULTS = {
    "system.checkpoint_dir": "checkpoints/ps_cli",
    "system.log_dir": "logs/ps_cli",
    "training.checkpoint_interval": 100,  # server versions (optimizer steps) between checkpoints
}
PS_FLAGS = {
    "workers": "system.num_workers",
    "servers": "system.num_servers",
    "shard_addresses": "system.shard_addresses",
    "aggregation_mode": "system.aggregation_mode",
    "server_address": "system.server_address",
    "transport": "system.transport",
    "tls_cert": "system.tls_cert_file",
    "tls_key": "system.tls_key_file",
    "tls_ca": "system.tls_ca_file",
    "local_steps": "system.local_steps",
    "streaming": "system.streaming",
    "pipelined_replies": "system.pipelined_replies",
    "downlink_compression": "system.downlink_compression",
    "downlink_ratio": "system.downlink_ratio",
    "downlink_refresh_interval": "system.downlink_refresh_interval",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    ps = parser.add_argument_group("parameter server")
    ps.add_argument("--workers", type=int, help="number of workers (default 2)")
    ps.add_argument(
        "--servers",
        type=int,
        help="parameter-server shards: the model split across this many server processes, each worker pushing "
        "to all at once (default 1; sync, --role local so far)",
    )
    ps.add_argument(
        "--aggregation-mode",
        choices=("sync", "async"),
        help="sync barrier per version, or apply each push (default sync)",
    )
    ps.add_argument("--local-steps", type=int, help="local SGD steps a worker takes per push (default 1)")
    ps.add_argument(
        "--streaming",
        action="store_const",
        const=True,
        help="workers communicate while they compute: each gradient is sent as backward produces it, and the "
        "next forward starts as its first layers' parameters arrive (same updates; default off)",
    )
    ps.add_argument(
        "--pipelined-replies",
        action="store_const",
        const=True,
        help="with --streaming, sync, --transport tcp: the server steps each slice of a parameter as soon as every "
        "worker's gradient of it is in and sends it back during the push; the barrier's step confirms each slice "
        "(same updates; default off)",
    )
    add_compression_flags(parser, "compression (worker pushes)")
    add_amp_flag(parser)  # the workers' forward/backward; the server's parameters stay float32
    downlink = parser.add_argument_group("downlink compression (push replies)")
    downlink.add_argument(
        "--downlink-compression",
        choices=("none", "topk", "quantization"),
        help="send each worker the change of the parameters since its copy, compressed (default none: dense)",
    )
    downlink.add_argument(
        "--downlink-ratio", type=float, help="fraction of entries a top-k downlink delta keeps (default 0.1)"
    )
    downlink.add_argument(
        "--downlink-refresh-interval",
        type=int,
        help="versions between dense refreshes of a worker's parameters (default 50)",
    )
    add_fault_tolerance_flags(parser)
    add_emulation_flags(parser)
    add_virtual_flags(parser)
    add_staleness_flags(parser)
    hosts = parser.add_argument_group("roles, hosts and security")
    hosts.add_argument(
        "--role",
        choices=("local", "server", "worker"),
        default="local",
        help="local: server + workers on this machine (default); server or worker: one role, for several hosts",
    )
    hosts.add_argument(
        "--server-address",
        help="host:port the server binds (server, local) or workers connect to "
        "(default 127.0.0.1:0, a free port; only local runs may use port 0)",
    )
    hosts.add_argument("--worker-id", type=int, help="this worker's id, 0..workers-1 (--role worker)")
    hosts.add_argument(
        "--shard-addresses",
        type=lambda text: [address for address in text.split(",") if address],
        help="A,B,...: every server shard's host:port, shard 0 first (a sharded run across hosts: "
        "each server binds its own entry, each worker connects to all; sets --servers)",
    )
    hosts.add_argument(
        "--shard", type=int, help="this server's shard, 0..servers-1 (--role server with --shard-addresses; default 0)"
    )
    hosts.add_argument(
        "--transport",
        choices=("grpc", "tcp"),
        help="how server and workers talk: grpc (default) or tcp (binary frames over TCP, fewer copies); "
        "the same on the server and every worker",
    )
    hosts.add_argument(
        "--tls-cert",
        help="server certificate (PEM); with --tls-key the server speaks TLS, "
        "a worker trusts it when no --tls-ca is given",
    )
    hosts.add_argument("--tls-key", help="server private key (PEM)")
    hosts.add_argument("--tls-ca", help="CA certificate workers verify the server against (PEM)")
    hosts.add_argument(
        "--resume-unfinished",
        metavar="DIR",
        help="server: continue from the newest checkpoint in DIR if the run there was interrupted "
        "(no newer final checkpoint), else start afresh; for restart policies (docker compose)",
    )
    return parser


def check_role_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that only some roles take (argparse's error, exit 2, names the flag)."""
    if (args.resume or args.resume_unfinished) and args.role == "worker":
        parser.error("--resume is for the server (--role server or local); a worker rejoins by registering again")
    if args.resume and args.resume_unfinished:
        parser.error("give --resume or --resume-unfinished, not both")
    if args.role == "worker" and args.worker_id is None:
        parser.error("--role worker needs --worker-id")
    if args.role != "worker" and args.worker_id is not None:
        parser.error("--worker-id is only for --role worker")
    if args.shard is not None and (args.role != "server" or not args.shard_addresses):
        parser.error("--shard is for --role server with --shard-addresses")
    if args.shard_addresses:
        if args.servers is None:
            args.servers = len(args.shard_addresses)
        if args.role == "local":
            parser.error("--shard-addresses is for --role server and --role worker (a local run picks its own)")
        if not 0 <= (args.shard or 0) < len(args.shard_addresses):
            parser.error(f"--shard {args.shard}: one of 0..{len(args.shard_addresses) - 1} (--shard-addresses)")
        if args.server_address is None:  # shard K binds its own entry; workers reach shard 0 at the first
            own = (args.shard or 0) if args.role == "server" else 0
            args.server_address = args.shard_addresses[own]
    if args.role == "worker" and args.artifacts_dir:
        parser.error("--artifacts-dir is for --role local or server (the server holds the run's summary)")


def checked_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Config:
    """The run's config from the flags, with the rules that join a setting to the role."""
    config = config_from_args(
        args,
        defaults=DEFAULTS,
        extra_flags={
            **PS_FLAGS,
            **COMPRESSION_FLAGS,
            **FAULT_TOLERANCE_FLAGS,
            **EMULATION_FLAGS,
            **STALENESS_FLAGS,
            **VIRTUAL_FLAGS,
            **AMP_FLAGS,
        },
        forced={"system.architecture": "parameter_server"},
    )
    if config.system.adaptive_compression and not config.training.eval_interval:
        parser.error(
            "--adaptive-compression decides at evaluations: give --eval-interval K (training.eval_interval, "
            "server versions between evaluations)"
        )
    if config.system.clock == "virtual" and args.role != "local":
        parser.error("--clock virtual simulates the whole job in this process: use it with --role local")
    if config.system.num_servers > 1:
        not_yet = [
            (
                args.role != "local" and not config.system.shard_addresses,
                f"--role {args.role} without --shard-addresses",
            ),
            (args.role == "local" and bool(args.resume or args.resume_unfinished), "--resume in a local run"),
        ]
        for refused, flag in not_yet:
            if refused:
                parser.error(f"--servers {config.system.num_servers}: not with {flag} yet")
    if args.role != "local" and config.system.server_address.endswith(":0"):
        parser.error(f"--role {args.role} needs a fixed port in --server-address, got {config.system.server_address}")
    return config


def run_role(args: argparse.Namespace, config: Config) -> None:
    """This process's role: one worker, the server alone, or the whole job here (real or virtual clock)."""
    from src.launch.ps import run_local
    from src.launch.ps_roles import run_server, run_worker

    resume = args.resume
    if args.resume_unfinished and not (args.role == "server" and args.shard):
        from src.common.checkpoint import unfinished_run_checkpoint

        resume = unfinished_run_checkpoint(args.resume_unfinished, "parameter_server")
        print(
            f"resuming the interrupted run from {resume}"
            if resume
            else f"no interrupted run in {args.resume_unfinished}: starting afresh",
            flush=True,
        )
    if args.role == "worker":
        totals = run_worker(config, args.worker_id)
        print(
            f"worker {args.worker_id}: {totals['samples']} samples in {totals['steps']} steps, "
            f"bytes sent {totals['bytes_sent']:,}, received {totals['bytes_received']:,}"
        )
        return
    if config.system.clock == "virtual":
        from src.virtual.run import run_virtual

        summary = run_virtual(config, summary_json=args.summary_json, resume=resume)
    elif args.role == "server" and args.shard:
        from src.launch.ps_roles import run_follower, wait_for_run_end

        recovering = bool(args.resume or args.resume_unfinished)  # it goes back to what shard 0 chooses
        if recovering:
            print(f"shard {args.shard}: starting again; it goes back to the version shard 0 chooses", flush=True)
        path = run_follower(
            config,
            args.shard,
            address=config.system.server_address,
            wait=lambda over: wait_for_run_end(config, over),
            recovering=recovering,
        )
        print(f"parameter-server shard {args.shard}: the run is over; its part of the model is in {path}")
        return
    else:
        summary = (run_server if args.role == "server" else run_local)(
            config, summary_json=args.summary_json, resume=resume
        )
    print(format_summary(summary))
    write_artifacts_if_asked(args, config, summary)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_role_flags(parser, args)
    config = checked_config(parser, args)

    from src.common.supervisor import LaunchError  # after flag checks: --help and flag errors stay fast
    from src.ps.state.refusals import IncarnationRevoked, RunFailed
    from src.transport.errors import CallError
    from src.transport.settings import AuthTokenMissing

    return exit_status(
        lambda: run_role(args, config),
        describe={
            LaunchError: str,
            AuthTokenMissing: str,
            RunFailed: str,
            IncarnationRevoked: str,
            CallError: lambda exc: f"parameter server call failed: {exc}",
        },
        interrupted="interrupted: stopped the parameter server and its workers",
    )


if __name__ == "__main__":
    sys.exit(main())
