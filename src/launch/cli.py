"""Command-line flags shared by the runners, and how they map onto config fields.

Every flag defaults to ``None`` ("not given"), so the precedence is: ``--set`` > flag > ``--config``
file > the runner's defaults > the schema's defaults. ``--set dotted.field=value`` (repeatable)
reaches every config field, nested ones too (``--set emulation.workers.1.slowdown=4``); the value is
read as YAML (``0.1``, ``true``, ``null``, ``[a, b]``). ``--print-config`` prints the resolved config
(secrets left out) and exits 0. :func:`config_from_args` turns a bad config into one line per problem
on stderr and exit status 2, never a traceback, and sets up logging (``--log-level``, :mod:`src.telemetry.logs`);
:func:`exit_status` holds the rest of the runners' exit contract (an expected failure: one
``error:`` line and 1; Ctrl-C: 130).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from typing import Any, Callable, Mapping

import yaml

from src.config import DATASET_NAMES, TRACKER_NAMES, Config, ConfigError, SetupError, load_config, nest_path

# flag dest -> dotted config field
COMMON_FLAGS: dict[str, str] = {
    "dataset": "training.dataset",
    "data_dir": "training.data_dir",
    "num_epochs": "training.num_epochs",
    "batch_size": "training.batch_size",
    "learning_rate": "training.learning_rate",
    "optimizer": "training.optimizer",
    "momentum": "training.momentum",
    "model": "training.model_architecture",
    "max_train_samples": "training.max_train_samples",
    "max_test_samples": "training.max_test_samples",
    "num_samples": "training.num_samples",
    "seed": "training.seed",
    "device": "training.device",
    "checkpoint_interval": "training.checkpoint_interval",
    "eval_interval": "training.eval_interval",
    "target_accuracy": "training.target_accuracy",
    "checkpoint_dir": "system.checkpoint_dir",
    "log_dir": "system.log_dir",
    "trace": "system.trace",
    "log_level": "system.log_level",
}


def parse_assignment(text: str) -> tuple[str, Any]:
    """``--set`` argument ``dotted.field=value`` -> ``(field, value read as YAML)``.

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty field name, or a value YAML cannot read.
    """
    field, sep, value = text.partition("=")
    field = field.strip()
    if not sep or not field:
        raise argparse.ArgumentTypeError(
            f"expected dotted.field=value (e.g. training.weight_decay=0.0001), got {text!r}"
        )
    try:
        nest_path(field, None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        return field, yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(
            f"{field}: value {value!r} is not valid YAML ({' '.join(str(exc).split())})"
        ) from None


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--set`` and ``--print-config``: any config field from the command line, and the resolved config."""
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        type=parse_assignment,
        metavar="FIELD=VALUE",
        help="set any config field, repeatable, applied after the other flags: "
        "--set training.weight_decay=1e-4 --set emulation.workers.1.slowdown=4 (value read as YAML; "
        "a secret belongs in $DTS_AUTH_TOKEN or the config file, not on a command line others can see)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML (secrets left out) and exit"
    )


def add_observability_flags(parser: argparse.ArgumentParser) -> None:
    """Logs, timelines and experiment trackers (``system.log_level``, ``system.trace``, ``metrics.trackers``)."""
    group = parser.add_argument_group("logs, timelines and trackers")
    group.add_argument(
        "--log-level",
        type=str.lower,
        choices=("debug", "info", "warning", "error"),
        help="level of the log lines on stderr, every process of the run (default info)",
    )
    group.add_argument(
        "--trace",
        action="store_const",
        const=True,
        help="write a Chrome trace-event timeline, trace.json in each process's log folder "
        "(open in ui.perfetto.dev or chrome://tracing; see src/telemetry/tracing.py)",
    )
    group.add_argument(
        "--tracker",
        action="append",
        choices=TRACKER_NAMES,
        metavar="NAME",
        help="also log the run to this tracker, repeatable: tensorboard, wandb, mlflow "
        "(added to metrics.trackers; wandb and mlflow need their extras: pip install -e .[wandb,mlflow])",
    )


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every runner takes (data, model, optimizer, outputs, resume, summary)."""
    parser.add_argument("--config", help="YAML or JSON config file (flags override its values)")
    add_config_flags(parser)
    add_observability_flags(parser)
    group = parser.add_argument_group("training")
    group.add_argument("--dataset", choices=DATASET_NAMES, help="dataset (default mnist_5k: bundled, offline)")
    group.add_argument("--data-dir", help="where torchvision datasets live / download to (default ./data)")
    group.add_argument("--num-epochs", type=int, help="epochs to train (default 2)")
    group.add_argument("--batch-size", type=int, help="samples per step per worker/rank (default 64)")
    group.add_argument("--learning-rate", type=float, help="learning rate (default 0.05)")
    group.add_argument("--optimizer", choices=("sgd", "adam"), help="optimizer (default sgd, momentum 0.9)")
    group.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    group.add_argument("--model", help="model architecture: simple_cnn, mlp, resnet18 (default simple_cnn)")
    group.add_argument("--max-train-samples", type=int, help="use only the first N training samples")
    group.add_argument("--max-test-samples", type=int, help="evaluate on only the first N test samples")
    group.add_argument("--num-samples", type=int, help="training-set size of --dataset synthetic (default 2048)")
    group.add_argument("--seed", type=int, help="seed for model init and data order (default 0)")
    group.add_argument("--device", help="cpu, cuda, cuda:N or auto (default auto: CUDA when available)")
    group.add_argument("--checkpoint-interval", type=int, help="epochs (PS: server versions) between checkpoints")
    group.add_argument(
        "--eval-interval", type=int, help="also evaluate every N steps (PS: server versions); 0 = epoch ends only"
    )
    group.add_argument(
        "--target-accuracy", type=float, help="report time to this test accuracy, in (0, 1] (default none)"
    )
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--checkpoint-dir", help="checkpoint folder")
    outputs.add_argument("--log-dir", help="TensorBoard logs, events.jsonl and summary.json folder")
    outputs.add_argument("--summary-json", help="run summary path (default <log-dir>/summary.json)")
    outputs.add_argument("--resume", help="continue from this checkpoint file or folder (newest good one)")
    outputs.add_argument(
        "--artifacts-dir",
        help="also write the report's input files here (baseline.json, ps.json + "
        "worker_metrics.json, ddp_rank_<r>.json, <name>_events.jsonl); "
        "see generate_performance_report.py",
    )


COMPRESSION_FLAGS: dict[str, str] = {
    "compression_enabled": "system.compression_enabled",
    "compression_type": "system.compression_type",
    "compression_ratio": "system.compression_ratio",
    "quantization_bits": "system.quantization_bits",
    "topk_selection": "system.topk_selection",
    "compression_value_dtype": "system.compression_value_dtype",
    "warmup_steps": "system.warmup_steps",
    "error_feedback": "system.error_feedback",
}


def add_compression_flags(parser: argparse.ArgumentParser, title: str) -> None:
    """Gradient compression flags (the parameter server's pushes, the DDP comm hook)."""
    group = parser.add_argument_group(title)
    group.add_argument("--compression-enabled", action="store_const", const=True, help="compress gradients on the wire")
    group.add_argument(
        "--compression-type", choices=("quantization", "topk"), help="compressor when enabled (default topk)"
    )
    group.add_argument(
        "--compression-ratio", type=float, help="fraction of entries top-k keeps, in (0, 1] (default 0.01)"
    )
    group.add_argument(
        "--quantization-bits", type=int, choices=(2, 4, 8), help="bits per entry of quantization (default 8)"
    )
    group.add_argument(
        "--topk-selection",
        choices=("exact", "sampled"),
        help="top-k selection: same entries, sampled is faster (default sampled)",
    )
    group.add_argument(
        "--compression-value-dtype",
        choices=("float32", "bfloat16", "float16"),
        help="what top-k's kept values travel in: 4 bytes each, or 2 (6 instead of 8 bytes per kept entry; "
        "default float32)",
    )
    group.add_argument("--warmup-steps", type=int, help="uncompressed steps before compression starts (default 0)")
    group.add_argument(
        "--no-error-feedback",
        dest="error_feedback",
        action="store_const",
        const=False,
        help="drop what compression leaves out instead of carrying it into the next step",
    )


AMP_FLAGS: dict[str, str] = {"amp": "training.amp"}


def add_amp_flag(parser: argparse.ArgumentParser) -> None:
    """Mixed precision of the runners that run the model themselves (baseline, DDP, parameter-server workers)."""
    group = parser.add_argument_group("mixed precision")
    group.add_argument(
        "--amp",
        choices=("none", "bf16", "fp16"),
        help="forward pass under torch.autocast in bfloat16 or float16 (fp16: with a GradScaler); "
        "parameters, optimizer and checkpoints stay float32 (training.amp, default none)",
    )


CONTROLLER_FLAGS: dict[str, str] = {
    "adaptive_compression": "system.adaptive_compression",
    "controller_policy": "system.controller_policy",
    "controller_rho_min": "system.controller_rho_min",
    "controller_rho_max": "system.controller_rho_max",
    "controller_rebound_threshold": "system.controller_rebound_threshold",
}

STALENESS_FLAGS: dict[str, str] = {
    "staleness_policy": "system.staleness_policy",
    "staleness_beta": "system.staleness_beta",
    "max_staleness": "system.max_staleness",
    "async_correction": "system.async_correction",
    "async_step_scale": "system.async_step_scale",
    **CONTROLLER_FLAGS,
}


def _add_controller_arguments(group, adaptive_help: str) -> None:
    group.add_argument("--adaptive-compression", action="store_const", const=True, help=adaptive_help)
    group.add_argument(
        "--controller-policy",
        choices=("link", "rebound"),
        help="how the controller picks rho: link (the fastest predicted step on the measured link, denser while "
        "the loss falls fast; default) or rebound (the spec's first controller)",
    )
    group.add_argument(
        "--controller-rho-min", type=float, help="lowest Active Fraction the controller sets (default 0.01)"
    )
    group.add_argument(
        "--controller-rho-max", type=float, help="highest Active Fraction the controller sets (default 0.5)"
    )
    group.add_argument(
        "--controller-rebound-threshold",
        type=float,
        help="Loss Rebound (nats) above which the controller compresses less (default 0.05)",
    )


def add_controller_flags(parser: argparse.ArgumentParser) -> None:
    """The adaptive compression controller alone (DDP: no staleness; every rank switches at the same step)."""
    group = parser.add_argument_group("adaptive compression")
    _add_controller_arguments(
        group,
        "let the controller set the top-k Active Fraction at every evaluation (needs "
        "--eval-interval and top-k compression; every rank switches at the same step; "
        "decisions are 'controller' events)",
    )


def add_staleness_flags(parser: argparse.ArgumentParser) -> None:
    """Asynchronous training: staleness policy, async correction, adaptive compression controller."""
    group = parser.add_argument_group("staleness and adaptive compression (async)")
    group.add_argument(
        "--staleness-policy",
        choices=("none", "soft", "hard", "both"),
        help="async pushes by staleness tau: none, soft (weight 1/(1+beta*tau)), hard (reject tau > "
        "--max-staleness), both (default none)",
    )
    group.add_argument("--staleness-beta", type=float, help="beta of soft attenuation, >= 0 (default 0.5)")
    group.add_argument("--max-staleness", type=int, help="S_max of the hard bound, >= 0 (default 8)")
    group.add_argument(
        "--async-correction",
        choices=("none", "implicit_momentum", "lookahead"),
        help="correction of async SGD for staleness (default lookahead: async trains like sync; "
        "none: the plain optimizer; see docs/async.md)",
    )
    group.add_argument(
        "--async-step-scale",
        type=float,
        help="lookahead: multiplier of each push's step (default: the stability-matched value, "
        "0.825 for 2 workers, 0.649 for 4)",
    )
    _add_controller_arguments(
        group,
        "let the controller set the top-k Active Fraction and S_max at every evaluation "
        "(needs --eval-interval; decisions are 'controller' events)",
    )


FAULT_TOLERANCE_FLAGS: dict[str, str] = {
    "inject_fault": "system.inject_faults",
    "max_restarts": "system.max_restarts",
    "max_rejoins": "system.max_rejoins",
    "heartbeat_interval": "system.heartbeat_interval",
    "heartbeat_timeout": "system.heartbeat_timeout",
}


def add_fault_tolerance_flags(parser: argparse.ArgumentParser, *, heartbeats: bool = True) -> None:
    """Restart budget and fault injection (both launchers); heartbeat timing (parameter server)."""
    group = parser.add_argument_group("fault tolerance")
    group.add_argument(
        "--max-restarts", type=int, help="restarts granted to each failed worker / the DDP group (default 3)"
    )
    group.add_argument(
        "--inject-fault",
        action="append",
        metavar="SPEC",
        help="inject a real fault, repeatable: kill:worker=1@step=40, hang:worker=0@step=30, "
        "pause=8:worker=0@step=30, "
        "kill:server@version=150, kill:rank=1@step=20 (see src/common/faults.py)",
    )
    if heartbeats:
        group.add_argument(
            "--max-rejoins",
            type=int,
            help="times a worker the server declared failed while it was alive (a partition, a long "
            "pause) registers again by itself as a new incarnation; then it exits (default 3)",
        )
        group.add_argument("--heartbeat-interval", type=float, help="seconds between a worker's heartbeats (default 1)")
        group.add_argument(
            "--heartbeat-timeout",
            type=float,
            help="seconds of silence after which a worker counts as failed (default 5)",
        )


EMULATION_FLAGS: dict[str, str] = {
    "slowdown": "emulation.slowdown",
    "slow_worker": "emulation.workers",
    "step_delay_s": "emulation.step_delay_s",
    "step_delay_sigma": "emulation.step_delay_sigma",
    "uplink_mbps": "emulation.uplink_mbps",
    "downlink_mbps": "emulation.downlink_mbps",
    "uplink_latency_ms": "emulation.uplink_latency_ms",
    "downlink_latency_ms": "emulation.downlink_latency_ms",
}


class _SlowWorker(argparse.Action):
    """``--slow-worker ID=FACTOR`` (repeatable) -> ``{ID: {"slowdown": FACTOR}}`` for ``emulation.workers``."""

    def __call__(self, parser, namespace, value, option_string=None):
        worker, sep, factor = value.partition("=")
        try:
            parsed = int(worker), float(factor)
        except ValueError:
            parser.error(f"{option_string}: expected ID=FACTOR (e.g. 1=4), got {value!r}")
        if not sep:
            parser.error(f"{option_string}: expected ID=FACTOR (e.g. 1=4), got {value!r}")
        workers = dict(getattr(namespace, self.dest, None) or {})
        workers[parsed[0]] = {"slowdown": parsed[1]}
        setattr(namespace, self.dest, workers)


def add_emulation_flags(parser: argparse.ArgumentParser) -> None:
    """Emulated stragglers and links of a parameter-server run (``emulation.*``, :mod:`src.emulation.netem`)."""
    group = parser.add_argument_group("emulation (stragglers and slow links on one machine; real waiting)")
    group.add_argument(
        "--slow-worker",
        action=_SlowWorker,
        metavar="ID=FACTOR",
        help="worker ID computes FACTOR times slower, repeatable (e.g. 1=4)",
    )
    group.add_argument("--slowdown", type=float, help="every worker computes this many times slower (default 1)")
    group.add_argument("--step-delay-s", type=float, help="seconds added to every step's compute (default 0)")
    group.add_argument(
        "--step-delay-sigma",
        type=float,
        help="log-normal spread of --step-delay-s (sigma of its log; default 0: constant)",
    )
    group.add_argument("--uplink-mbps", type=float, help="worker -> server bandwidth, Mbit/s (default: not limited)")
    group.add_argument("--downlink-mbps", type=float, help="server -> worker bandwidth, Mbit/s (default: not limited)")
    group.add_argument("--uplink-latency-ms", type=float, help="worker -> server latency per message, ms (default 0)")
    group.add_argument("--downlink-latency-ms", type=float, help="server -> worker latency per message, ms (default 0)")


VIRTUAL_FLAGS: dict[str, str] = {
    "clock": "system.clock",
    "compute_s": "emulation.compute_s",
    "compress_s": "emulation.compress_s",
    "server_update_s": "emulation.server_update_s",
    "server_reply_s": "emulation.server_reply_s",
    "server_mbps": "emulation.server_mbps",
    "restart_s": "emulation.restart_s",
}


def add_virtual_flags(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """``--clock virtual`` and the cost model's figures (``emulation.*``, :mod:`src.emulation.cost_model`)."""
    group = parser.add_argument_group(
        "virtual time (one process, time from a cost model: deterministic; figures from scripts/calibrate.py)"
    )
    group.add_argument(
        "--clock",
        choices=("real", "virtual"),
        help="real: processes on the wall clock (default); virtual: simulated time from the cost model",
    )
    group.add_argument("--compute-s", type=float, help="virtual: seconds of one step's forward/backward per batch")
    group.add_argument("--compress-s", type=float, help="virtual: seconds of error feedback + compression per push")
    if server:
        group.add_argument("--server-update-s", type=float, help="virtual: the server's seconds per push")
        group.add_argument("--server-reply-s", type=float, help="virtual: the server's seconds per reply")
        group.add_argument(
            "--server-mbps",
            type=float,
            help="virtual: server NIC bandwidth each way, Mbit/s, shared fairly (default: not limited)",
        )
    group.add_argument("--restart-s", type=float, help="virtual: seconds a killed process takes to restart")


def overrides_from_args(args: argparse.Namespace, flags: Mapping[str, str]) -> dict[str, Any]:
    """Dotted overrides for the flags that were given."""
    return {field: getattr(args, dest) for dest, field in flags.items() if getattr(args, dest, None) is not None}


def config_from_args(
    args: argparse.Namespace,
    *,
    defaults: Mapping[str, Any],
    extra_flags: Mapping[str, str] | None = None,
    forced: Mapping[str, Any] | None = None,
) -> Config:
    """Load the config for a runner, exiting with status 2 and one line per problem if it is bad.

    Also sets up this process's logging at ``system.log_level``, and with ``--print-config`` prints
    the resolved config and exits 0.

    Args:
        defaults: the runner's defaults below the file (output folders, architecture).
        extra_flags: the runner's own flag -> field mapping, on top of :data:`COMMON_FLAGS`.
        forced: fields the runner fixes whatever the file says (e.g. its architecture).
    """
    from src.telemetry.logs import setup_logging

    flags = {**COMMON_FLAGS, **(extra_flags or {})}
    overrides = {**overrides_from_args(args, flags), **(forced or {})}
    assignments = dict(getattr(args, "assignments", None) or [])  # the last --set of a field wins
    fixed = [field for field in assignments if field in (forced or {})]
    if fixed:
        print(
            f"config error: {fixed[0]}: fixed by this runner to {forced[fixed[0]]!r}, cannot be --set", file=sys.stderr
        )
        raise SystemExit(2)
    try:
        config = load_config(args.config, overrides=overrides, defaults=defaults, assignments=assignments)
        trackers = getattr(args, "tracker", None)
        if trackers:
            config.metrics.trackers = list(dict.fromkeys([*config.metrics.trackers, *trackers]))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    if getattr(args, "print_config", False):
        print(format_config(config), end="")
        raise SystemExit(0)
    setup_logging(config.system.log_level)
    return config


def format_config(config: Config) -> str:
    """The resolved config as YAML, the way a ``--config`` file reads it (secrets are never dumped)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def write_artifacts_if_asked(args: argparse.Namespace, config: Config, summary: Mapping[str, Any]) -> None:
    """``--artifacts-dir``: the run's report inputs, from its summary and its log folder (src/reports/inputs.py)."""
    if getattr(args, "artifacts_dir", None):
        from src.reports.inputs import write_artifacts

        written = write_artifacts(args.artifacts_dir, summary, config.system.log_dir)
        print(f"artifacts: {', '.join(str(path) for path in written)}")


def exit_status(
    run: Callable[[], None],
    *,
    describe: Mapping[type[BaseException], Callable[[Any], str]] | None = None,
    interrupted: str = "interrupted",
) -> int:
    """Run a runner's work and turn its outcome into the exit status every runner shares.

    Expected failures (a missing dataset, an unusable checkpoint, a setup problem the user fixes
    (:class:`~src.config.SetupError`), and the types in ``describe``) print one ``error:`` line and
    give 1; Ctrl-C prints ``interrupted`` and gives 130
    (the runner's launcher has stopped its children by then). Anything else is a bug and keeps
    its traceback.

    Args:
        run: does the work and prints the summary.
        describe: extra exception types -> their one-line description (default ``str``).
        interrupted: what to print on Ctrl-C.
    """
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints where every thread is: a stuck run tells why
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError):  # a stderr without a file descriptor (captured in process): no dump
            pass
    try:
        run()
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except Exception as exc:
        expected = {**_loaded(EXPECTED_ERRORS), SetupError: str, **(describe or {})}
        line = next((text for kind, text in expected.items() if isinstance(exc, kind)), None)
        if line is None:
            raise
        print(f"error: {line(exc)}", file=sys.stderr)
        return 1
    return 0


EXPECTED_ERRORS = (("src.training.data", "DatasetUnavailableError"), ("src.common.checkpoint", "CheckpointError"))
"""Every runner's expected failures beyond :class:`~src.config.SetupError`, by module and name: both modules import
torch, which a launcher whose children train need not load (the parameter server's, 1-1.5 s)."""


def _loaded(errors: tuple[tuple[str, str], ...]) -> dict[type[BaseException], Callable[[Any], str]]:
    """Those of ``errors`` whose module has been imported (an error of a module never imported was not raised)."""
    return {getattr(sys.modules[module], name): str for module, name in errors if module in sys.modules}
