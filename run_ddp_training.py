"""Ring-allreduce DDP training: N ranks of torch DistributedDataParallel (gloo on CPU, nccl on CUDA).

    python run_ddp_training.py --world-size 1 --dataset mnist --num-epochs 1
    python run_ddp_training.py --world-size 2 --dataset mnist --num-epochs 2
    python run_ddp_training.py --dataset synthetic --world-size 2 --num-epochs 1 --num-samples 2048 --optimizer sgd
    python run_ddp_training.py --world-size 2 --allreduce ring                       # explicit ring hook
    python run_ddp_training.py --world-size 2 --compression-enabled --compression-type topk --compression-ratio 0.01
    python run_ddp_training.py --world-size 2 --compression-enabled --compression-ratio 0.1 \\
        --adaptive-compression --eval-interval 20
    python run_ddp_training.py --world-size 2 --resume checkpoints/ddp_cli --num-epochs 4
    python run_ddp_training.py --world-size 2 --checkpoint-interval-steps 20 --inject-fault kill:rank=1@step=30
    python run_ddp_training.py --world-size 2 --checkpoint-interval-steps 20 --collective-timeout 10 \\
        --inject-fault hang:rank=1@step=30
    python run_ddp_training.py --world-size 2 --amp bf16 --compression-enabled --compression-ratio 0.1 \\
        --compression-value-dtype bfloat16

Virtual time (one process, the N ranks computed in turn, each step's exchange costed by the ring
model on the configured link; deterministic; figures from scripts/calibrate.py --no-server):

    python run_ddp_training.py --clock virtual --world-size 16 --compute-s 0.02 --set emulation.uplink_mbps=1000

Across machines, the same script under torchrun (it reads RANK / WORLD_SIZE / MASTER_ADDR and spawns
nothing); run on each of the two nodes:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29400 \\
        --rdzv-id ddp_job --max-restarts 3 run_ddp_training.py --num-epochs 2

Fault tolerance: the local launcher is torch's elastic agent (the one torchrun runs). A rank that
dies takes the group down and the agent starts it again, up to --max-restarts times (torchrun's own
--max-restarts under torchrun); the new attempt continues from the newest checkpoint of this job
(--checkpoint-interval-steps K adds a checkpoint every K steps). --inject-fault kill:rank=R@step=N
SIGKILLs rank R at its Nth step, in the first attempt only (hang:rank=R@step=N SIGSTOPs it). A hung
rank (no heartbeat for --collective-timeout seconds, default 60) is killed and the attempt ends the
same way (src/ddp/watchdog.py).

Adaptive compression: --adaptive-compression (top-k only, needs --eval-interval K) lets the controller
of src/adaptive/controller.py set the top-k Active Fraction at every evaluation; rank 0 decides, the decision
is broadcast and every rank switches at the same step (src/ddp/control.py).

Outputs: checkpoints in checkpoints/ddp_cli (ddp_final.pt + numbered), logs/ddp_cli/summary.json,
logs/ddp_cli/ddp_rank_<r>.json, and TensorBoard + events.jsonl under logs/ddp_cli/rank_<r>
(change with --checkpoint-dir / --log-dir / --summary-json); with --artifacts-dir DIR also
DIR/ddp_rank_<r>.json and DIR/ddp_events.jsonl for generate_performance_report.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from src.launch.cli import (
    AMP_FLAGS,
    COMPRESSION_FLAGS,
    CONTROLLER_FLAGS,
    FAULT_TOLERANCE_FLAGS,
    VIRTUAL_FLAGS,
    add_amp_flag,
    add_common_flags,
    add_compression_flags,
    add_controller_flags,
    add_fault_tolerance_flags,
    add_virtual_flags,
    config_from_args,
    exit_status,
    write_artifacts_if_asked,
)
from src.metrics import format_summary

DEFAULTS = {"system.checkpoint_dir": "checkpoints/ddp_cli", "system.log_dir": "logs/ddp_cli"}
DDP_FLAGS = {
    "world_size": "system.num_workers",
    "allreduce": "system.allreduce",
    "backend": "system.backend",
    "checkpoint_interval_steps": "training.checkpoint_interval_steps",
    "collective_timeout": "system.collective_timeout_s",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    ddp = parser.add_argument_group("ddp")
    ddp.add_argument(
        "--world-size",
        type=int,
        help="local ranks to spawn (system.num_workers, default 2); under torchrun its WORLD_SIZE decides",
    )
    ddp.add_argument(
        "--allreduce",
        choices=("default", "ring"),
        help="gradient allreduce: the backend's (default) or the explicit ring hook",
    )
    ddp.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), help="auto: nccl on CUDA, gloo on CPU (default auto)"
    )
    ddp.add_argument(
        "--checkpoint-interval-steps",
        type=int,
        help="also checkpoint every N optimizer steps, mid-epoch too (default 0: epoch checkpoints only)",
    )
    add_amp_flag(parser)
    add_compression_flags(parser, "compression (DDP comm hook)")
    add_controller_flags(parser)
    add_fault_tolerance_flags(parser, heartbeats=False)
    add_virtual_flags(parser, server=False)
    ddp.add_argument(
        "--collective-timeout",
        type=float,
        metavar="SECONDS",
        help="a collective waits at most this long for its peers, and a rank silent (no heartbeat) this long is hung: "
        "either fails the attempt and the group restarts from its newest checkpoint (system.collective_timeout_s, "
        "default 60)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(
        args,
        defaults=DEFAULTS,
        extra_flags={
            **DDP_FLAGS,
            **AMP_FLAGS,
            **COMPRESSION_FLAGS,
            **CONTROLLER_FLAGS,
            **FAULT_TOLERANCE_FLAGS,
            **VIRTUAL_FLAGS,
        },
        forced={"system.architecture": "ddp"},
    )
    system = config.system
    if system.adaptive_compression and not config.training.eval_interval:
        parser.error(
            "--adaptive-compression decides at evaluations: give --eval-interval K (training.eval_interval, "
            "steps between evaluations)"
        )
    if system.adaptive_compression and not (system.compression_enabled and system.compression_type == "topk"):
        parser.error(
            "--adaptive-compression sets top-k's Active Fraction: give --compression-enabled with "
            "--compression-type topk (system.compression_enabled, system.compression_type)"
        )

    if system.clock == "virtual" and (args.resume or system.adaptive_compression or config.training.amp != "none"):
        parser.error("--clock virtual runs DDP without --resume, --adaptive-compression or --amp (not simulated)")

    from src.common.supervisor import LaunchError
    from src.launch.ddp import launch, torchrun_env  # torch loads after the flags are checked: --help stays fast

    def run() -> None:
        if system.clock == "virtual":
            from src.virtual.ddp import run_virtual_ddp

            summary = run_virtual_ddp(config, summary_json=args.summary_json)
            print(format_summary(summary))
            write_artifacts_if_asked(args, config, summary)
            return
        summary = launch(config, world_size_flag=args.world_size, resume=args.resume, summary_json=args.summary_json)
        env = torchrun_env()
        if env is None or env["rank"] == 0:
            print(format_summary(summary))
            write_artifacts_if_asked(args, config, summary)

    return exit_status(run, describe={LaunchError: str})


if __name__ == "__main__":
    status = main()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun rank: see leave_rank_process
        from src.ddp_trainer import leave_rank_process

        leave_rank_process(status)
    sys.exit(status)
