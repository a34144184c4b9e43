"""Parameter-server training: a gRPC server holds the model, N workers push gradients and pull parameters.

One machine (the server and the workers as processes, random auth token per run):

    python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2
    python run_parameter_server_training.py --workers 4 --dataset mnist --num-epochs 2
    python run_parameter_server_training.py --workers 2 --dataset mnist --num-epochs 2 \\
        --aggregation-mode async --compression-enabled --compression-type topk --compression-ratio 0.1
    python run_parameter_server_training.py --config configs/ps_sync_mnist.yaml --dataset mnist_5k

Several hosts (same token everywhere, from $DTS_AUTH_TOKEN or system.auth_token):

    host A$ python run_parameter_server_training.py --role server --server-address 0.0.0.0:50051 --workers 2 ...
    host B$ python run_parameter_server_training.py --role worker --worker-id 0 --server-address A:50051
    host C$ python run_parameter_server_training.py --role worker --worker-id 1 --server-address A:50051

The server decides the run (dataset, model, epochs, batch size, mode, compression); a worker takes
only its local settings (--data-dir, --device, --log-dir, TLS files) from its own flags.

Outputs: the final summary on the terminal, checkpoints/ps_cli/parameter_server_final.pt (the common
checkpoint format), logs/ps_cli/summary.json, and events.jsonl + TensorBoard logs under
logs/ps_cli/server and logs/ps_cli/worker_<k> (change with --checkpoint-dir / --log-dir).
"""

from __future__ import annotations

import argparse
import sys

from src.cli import (
    COMPRESSION_FLAGS, STALENESS_FLAGS, add_common_flags, add_compression_flags, add_staleness_flags, config_from_args,
    exit_status,
)
from src.metrics import format_summary

DEFAULTS = {
    "system.checkpoint_dir": "checkpoints/ps_cli",
    "system.log_dir": "logs/ps_cli",
    "training.checkpoint_interval": 100,  # server versions (optimizer steps) between checkpoints
}
PS_FLAGS = {
    "workers": "system.num_workers",
    "aggregation_mode": "system.aggregation_mode",
    "server_address": "system.server_address",
    "tls_cert": "system.tls_cert_file",
    "tls_key": "system.tls_key_file",
    "tls_ca": "system.tls_ca_file",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    ps = parser.add_argument_group("parameter server")
    ps.add_argument("--workers", type=int, help="number of workers (default 2)")
    ps.add_argument("--aggregation-mode", choices=("sync", "async"), help="sync barrier per version, or apply each push (default sync)")
    add_compression_flags(parser, "compression (worker pushes)")
    add_staleness_flags(parser)
    hosts = parser.add_argument_group("roles, hosts and security")
    hosts.add_argument("--role", choices=("local", "server", "worker"), default="local",
                       help="local: server + workers on this machine (default); server or worker: one role, for several hosts")
    hosts.add_argument("--server-address", help="host:port the server binds (server, local) or workers connect to "
                                                "(default 127.0.0.1:0, a free port; only local runs may use port 0)")
    hosts.add_argument("--worker-id", type=int, help="this worker's id, 0..workers-1 (--role worker)")
    hosts.add_argument("--tls-cert", help="server certificate (PEM); with --tls-key the server speaks TLS, "
                                          "a worker trusts it when no --tls-ca is given")
    hosts.add_argument("--tls-key", help="server private key (PEM)")
    hosts.add_argument("--tls-ca", help="CA certificate workers verify the server against (PEM)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        parser.error("--resume is not supported for the parameter server yet (recovery comes with the coordinator)")
    if args.role == "worker" and args.worker_id is None:
        parser.error("--role worker needs --worker-id")
    if args.role != "worker" and args.worker_id is not None:
        parser.error("--worker-id is only for --role worker")
    config = config_from_args(args, defaults=DEFAULTS, extra_flags={**PS_FLAGS, **COMPRESSION_FLAGS, **STALENESS_FLAGS}, forced={"system.architecture": "parameter_server"})
    if config.system.adaptive_compression:  # src/controller.py is ready; the server does not feed it events yet
        parser.error("--adaptive-compression (system.adaptive_compression) is not wired into the parameter server yet")
    if args.role != "local" and config.system.server_address.endswith(":0"):
        parser.error(f"--role {args.role} needs a fixed port in --server-address, got {config.system.server_address}")

    import grpc  # after flag checks: --help and flag errors stay fast

    from src.ps_launcher import run_local, run_server, run_worker
    from src.supervisor import LaunchError
    from src.ps_transport import AuthTokenMissing

    def run() -> None:
        if args.role == "worker":
            totals = run_worker(config, args.worker_id)
            print(f"worker {args.worker_id}: {totals['samples']} samples in {totals['steps']} steps, "
                  f"bytes sent {totals['bytes_sent']:,}, received {totals['bytes_received']:,}")
            return
        summary = (run_server if args.role == "server" else run_local)(config, summary_json=args.summary_json)
        print(format_summary(summary))

    return exit_status(run, describe={
        LaunchError: str,
        AuthTokenMissing: str,
        grpc.RpcError: lambda exc: f"parameter server call failed: {exc.code().name}: {exc.details()}",
    }, interrupted="interrupted: stopped the parameter server and its workers")


if __name__ == "__main__":
    sys.exit(main())
