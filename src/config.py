"""Run configuration: the ``training`` and ``system`` sections, validated with pydantic v2.

A config comes from four layers, lowest first: the runner's defaults (its output folders), a YAML
or JSON file (``--config``), command-line flags, then ``--set dotted.field=value`` assignments (any
field, nested ones too: ``emulation.workers.1.slowdown=4``). :func:`load_config` merges them and
validates once, so every rule lives here and every error names its dotted field, the bad value and
the rule::

    system.compression_ratio: must be in (0, 1], got 1.5

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from src.adaptive.settings import ControllerSettings
from src.common.validation import Section, bounded, describe
from src.training.lr_schedule import LRScheduleConfig

DATASET_NAMES = ("mnist", "fashion_mnist", "cifar10", "mnist_5k", "synthetic")
SECRET_FIELDS = ("system.auth_token",)
"""Fields whose values an error message must never show."""


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class SetupError(ValueError):
    """A problem the user fixes in the run's setup (an address, a TLS file, a device, a checkpoint
    that does not fit): runners print it as one ``error:`` line. Anything else is a bug and keeps its
    traceback."""


def _controller_setting(name: str, **extra: Any) -> Any:
    """The ``system.controller_<name>`` field: its default and bounds are the controller's own
    (:class:`src.adaptive.settings.ControllerSettings`, the one declaration of them)."""
    setting = ControllerSettings.__dataclass_fields__[name]
    finite = {"allow_inf_nan": False} if isinstance(setting.default, float) else {}
    return Field(setting.default, **setting.metadata, **finite, **extra)


class TrainingConfig(Section):
    """What is trained and how: data, model, optimizer, schedule."""

    batch_size: PositiveInt = 64
    """Samples per step per worker (per rank for DDP)."""
    learning_rate: float = Field(0.05, gt=0, allow_inf_nan=False)
    num_epochs: PositiveInt = 2
    dataset: Literal["mnist", "fashion_mnist", "cifar10", "mnist_5k", "synthetic"] = "mnist_5k"
    """``mnist_5k`` is bundled and works offline; the torchvision sets download into ``data_dir``."""
    model_architecture: str = "simple_cnn"
    """A name from ``src.training.models.MODELS``."""
    checkpoint_interval: PositiveInt = 1
    """Epochs between checkpoints (baseline, DDP) or server versions between checkpoints (PS)."""
    checkpoint_interval_steps: int = bounded(0, ge=0, why="0 = checkpoint only at epoch ends")
    """DDP: also checkpoint every this many optimizer steps (mid-epoch too); 0 = epoch checkpoints only."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    seed: int = 0
    data_dir: str = "./data"
    max_train_samples: int | None = bounded(None, gt=0, why="or omitted for all samples")
    """Use only the first N training samples (smoke runs); ``None`` uses all."""
    max_test_samples: int | None = bounded(None, gt=0, why="or omitted for all samples")
    num_samples: PositiveInt = 2048
    """Training-set size of the ``synthetic`` dataset."""
    eval_batch_size: PositiveInt = 1000
    eval_interval: int = bounded(0, ge=0, why="0 = evaluate only at epoch ends")
    """Also evaluate every this many steps (parameter server: server versions); 0 = only at epoch ends."""
    eval_at_epoch_ends: bool = True
    """Evaluate at every epoch's end; ``False``: only at the run's end (and every ``eval_interval`` /
    ``eval_every_samples``). Throughput benchmarks turn it off so no evaluation runs inside a training clock:
    DDP and the baseline pause their clocks to evaluate, a parameter server evaluates on a thread beside its
    workers, which on a machine they share takes the workers' CPU."""
    eval_every_samples: int = bounded(0, ge=0, why="0 = evaluate only at epoch ends")
    """Also evaluate each time the samples applied (all workers or ranks together) pass a multiple of this
    (0 = off): sync and async runs, PS and DDP, are then scored at the same sample counts. Pick a multiple
    of num_workers x batch_size so every run lands exactly on the counts."""
    target_accuracy: float | None = bounded(None, gt=0, le=1, why="or omitted for no target")
    """Accuracy in (0, 1] whose first crossing the summary reports as time to target; ``None`` for none."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available, else CPU)."""
    amp: Literal["none", "bf16", "fp16"] = "none"
    """Mixed precision (baseline and DDP trainers, parameter-server workers): the forward pass under
    ``torch.autocast`` in bfloat16 or float16 (fp16 with a GradScaler); parameters, optimizer state and
    checkpoints stay float32."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """The learning rate by step (parameter server: by version); see :class:`LRScheduleConfig`."""

    @field_validator("model_architecture")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from src.training.models import MODELS  # models sit below config; imported late to keep loading cheap

        if not value.strip():
            raise ValueError("must be a non-empty model name")
        if value not in MODELS:
            raise ValueError(f"unknown model (known: {', '.join(sorted(MODELS))})")
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if value in ("cpu", "cuda", "auto") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("must be cpu, cuda, cuda:N or auto")


class SystemConfig(Section):
    """How it is distributed: architecture, workers, compression, fault tolerance, outputs."""

    num_workers: PositiveInt = 2
    """Parameter-server workers, or DDP world size."""
    architecture: Literal["baseline", "parameter_server", "ddp"] = "parameter_server"
    aggregation_mode: Literal["sync", "async"] = "sync"
    compression_enabled: bool = False
    compression_type: Literal["quantization", "topk"] = "topk"
    compression_ratio: float = Field(0.01, gt=0, le=1)
    """Fraction of entries top-k keeps."""
    quantization_bits: Literal[2, 4, 8] = 8
    quantization_bucket_size: PositiveInt = 512
    topk_selection: Literal["exact", "sampled"] = "sampled"
    """Same entries either way (sampled corrects its threshold estimate to the exact top-k); sampled is faster."""
    compression_value_dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", validate_default=True)
    """What top-k's kept values travel in: 4 bytes each, or 2 (a kept entry is then 6 bytes instead of 8)."""
    error_feedback: bool = True
    """Keep what compression dropped and add it to the next gradient."""
    gradient_ledger: bool = False
    """Audit Error Feedback over a parameter-server run: each worker writes the sum of the gradients it
    computed and its final residuals, the server the sum of the gradients it applied
    (``gradient_ledger.pt`` in each log folder); computed = applied + residuals."""
    warmup_steps: NonNegativeInt = 0
    """Uncompressed sends before compression starts."""
    staleness_policy: Literal["none", "soft", "hard", "both"] = "none"
    """Async pushes by Staleness tau: none (full weight), soft (weight 1/(1+beta*tau)), hard (reject tau > S_max),
    both."""
    staleness_beta: float = Field(0.5, ge=0, allow_inf_nan=False)
    """beta of soft attenuation, >= 0."""
    max_staleness: NonNegativeInt = 8
    """S_max of the hard bound: an async push with tau > S_max is rejected (the worker rolls back)."""
    downlink_compression: Literal["none", "topk", "quantization"] = "none"
    """How push replies carry the parameters: dense, or a compressed delta since the worker's copy
    (top-k keeps ``downlink_ratio`` of the entries; quantization uses ``quantization_bits``)."""
    downlink_ratio: float = Field(0.1, gt=0, le=1)
    """Fraction of entries a top-k downlink delta keeps, in (0, 1]."""
    downlink_refresh_interval: PositiveInt = 50
    """Versions after which a worker gets the dense parameters again (downlink compression)."""
    downlink_drift_bound: float = Field(0.03, gt=0, allow_inf_nan=False)
    """Largest relative distance ``||server - worker|| / ||server||`` a downlink delta may leave; beyond it, a
    dense refresh."""
    local_steps: PositiveInt = 1
    """Local optimizer steps (plain SGD at the learning rate) a PS worker takes between pushes; it
    pushes the sum of their gradients. 1 = one gradient per push."""
    # --- async correction and adaptive compression (src/ps/state/staleness.py, src/adaptive/controller.py) ---
    async_correction: Literal["none", "implicit_momentum", "lookahead"] = "lookahead"
    """Async SGD's correction for staleness: lookahead (per-worker momentum, lr/N per push, pulls at the
    lookahead point: N async workers take the steps of N sync workers), implicit_momentum (explicit
    momentum lowered by 1 - 1/N), none (the plain optimizer)."""
    async_step_scale: float | None = bounded(
        None, gt=0, allow_inf_nan=False, why="or null for the stability-matched default"
    )
    """lookahead: multiplier of every push's step; null = the stability-matched default (0.825 for 2
    workers, 0.649 for 4 at momentum 0.9; 1.0 = exactly a sync step per N pushes)."""
    adaptive_compression: bool = False
    """Let the controller set the top-k Active Fraction rho and S_max from the event stream."""
    controller_rho_min: float = _controller_setting("rho_min")
    """Lowest Active Fraction the controller may set, in (0, 1]."""
    controller_rho_max: float = _controller_setting(
        "rho_max", validate_default=True
    )  # checked against rho_min even when not given
    """Highest Active Fraction the controller may set, in [controller_rho_min, 1]."""
    controller_max_staleness_min: int = _controller_setting("max_staleness_min")
    """Tightest S_max the controller may set, >= 0."""
    controller_max_staleness_max: int = _controller_setting("max_staleness_max", validate_default=True)
    """Loosest S_max the controller may set, >= controller_max_staleness_min."""
    controller_rebound_threshold: float = _controller_setting("rebound_threshold")
    """Loss Rebound (mean positive jump of eval loss between evaluations, nats) above which it compresses less."""
    controller_rebound_window: int = _controller_setting("rebound_window")
    """Consecutive evaluation pairs the Loss Rebound averages over, > 0."""
    controller_stable_evaluations: int = _controller_setting("stable_evaluations")
    """Evaluations in a row without a rebound before it compresses more, > 0."""
    controller_communication_share: float = _controller_setting("communication_share")
    """Communication share of step time, in [0, 1], at or above which communication dominates."""
    controller_instability_persistence: int = _controller_setting("instability_persistence")
    """Evaluations in a row with a Loss Rebound above the threshold before it compresses less (hysteresis:
    a lone bump is held, not acted on), > 0; 1 = act at the first."""
    controller_policy: Literal["link", "rebound"] = "link"
    """How the controller picks rho: link (the Active Fraction, or none, whose predicted step is fastest, from
    the pushes' bytes and times; needs a probe window) or rebound (the spec's first controller: halve rho while
    calm and communication-bound, double it on a Loss Rebound)."""
    controller_step_slack: float = _controller_setting("step_slack")
    """link, outside the critical regime: the densest rho whose predicted step is within this fraction of the fastest,
    >= 0."""
    controller_critical_drop: float = _controller_setting("critical_drop")
    """link: an evaluation whose loss fell by at least this fraction since the previous one is in the critical
    regime (early training), >= 0."""
    controller_critical_slack: float = _controller_setting("critical_slack")
    """link, critical regime: the densest rho whose predicted step is within this fraction of the fastest, >= 0."""
    heartbeat_interval: float = Field(1.0, gt=0, allow_inf_nan=False)
    heartbeat_timeout: float = Field(5.0, gt=0, allow_inf_nan=False)
    """Seconds of silence after which a worker counts as failed; must exceed the interval."""
    max_restarts: NonNegativeInt = 3
    """Restarts a local launcher grants each failed worker (PS) or the DDP group (elastic agent)."""
    max_rejoins: NonNegativeInt = 3
    """Times a PS worker process whose incarnation the server revoked (declared failed while it was
    alive: a partition, a long pause) registers again by itself as a new incarnation; then it exits 1."""
    inject_faults: list[str] = []
    """Faults to inject on purpose (:mod:`src.common.faults`), e.g. ``kill:worker=1@step=40``,
    ``kill:server@version=150``."""
    checkpoint_dir: str = "checkpoints"
    log_dir: str = "logs"
    server_address: str = "127.0.0.1:0"
    """Where the parameter server listens / workers connect; port 0 lets the local launcher pick."""
    num_servers: PositiveInt = 1
    """Parameter-server shards: the model split across this many server processes (:mod:`src.ps.shards.placement`;
    sync or async); 1: one server holds every parameter."""
    shard_slice_bytes: PositiveInt = 4 << 20
    """With num_servers > 1: a tensor above this many bytes is cut into slices across the shards (BytePS's 4 MB
    partitions); smaller ones go whole to the shard with the fewest bytes."""
    shard_addresses: list[str] = []
    """Every shard's ``host:port``, shard 0 first, for a sharded run across hosts (each shard binds its own
    entry, workers connect to all); empty: the local launcher picks them."""
    streaming: bool = False
    """Parameter server: a worker communicates while it computes (:mod:`src.ps.worker.streaming`). Its push leaves in
    parts as backward produces the gradients (each compensated and compressed as it is ready), and the reply comes
    back in forward order, so the next forward starts once its first layers' parameters are in and waits for a later
    one only if it must. The same push, verdict and update as without it: only when the bytes travel changes.
    Needs ``local_steps`` 1 and no fp16 ``training.amp`` (their gradients are whole only after backward)."""
    pipelined_replies: bool = False
    """With ``streaming``, sync: the server steps each slice of a parameter as soon as every worker's gradient of it
    is in and sends it back at once, while the rest of the push is still on its way (P3, BytePS); the barrier's own
    step confirms each slice bit for bit, and a reply leaves out what a worker already holds
    (:mod:`src.ps.state.slice_pipeline`). The same updates as without it. Dense float32 gradients only (a compressed one
    travels and comes back as before); no emulated links in real time (virtual time models them); over TCP, no TLS
    (gRPC does its own); with several shards (``num_servers``), over TCP (each shard steps its holds' slices, and a
    pull leaves out what the worker holds)."""
    pipeline_slice_bytes: PositiveInt = 128 << 10
    """With ``pipelined_replies``: bytes of a slice (rounded down to a multiple of 64 float32 values)."""
    transport: Literal["grpc", "tcp"] = "grpc"
    """How the parameter server and its workers talk: gRPC, or length-prefixed binary frames over TCP
    (:mod:`src.transport.tcp`: same messages, auth, sessions, TLS and limits, fewer copies). Both ends
    must use the same one."""
    auth_token: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Shared secret every RPC carries; ``None`` reads $DTS_AUTH_TOKEN or makes one per local run.

    A secret: excluded from every dump (:meth:`Config.to_dict`, JSON), so it never reaches events,
    checkpoints or summaries, and never echoed in an error message."""
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    clock: Literal["real", "virtual"] = "real"
    """real: processes on the wall clock; virtual: one process on a virtual clock, time from the cost model in
    ``emulation`` (:mod:`src.virtual.run`): deterministic, and 64 workers fit on 2 cores."""
    allreduce: Literal["default", "ring"] = "default"
    """DDP gradient exchange: the backend's allreduce, or the explicit ring hook."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    trace: bool = False
    """Write a Chrome trace-event timeline, ``trace.json`` in each process's log folder
    (:mod:`src.telemetry.tracing`)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Level of the Python log records every process of the run writes to stderr (:mod:`src.telemetry.logs`)."""
    collective_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """DDP: seconds a collective may wait for its peers (the process group's timeout), and seconds
    without a rank's heartbeat after which it counts as hung; either fails the attempt, and the
    elastic agent restarts the group from its newest checkpoint."""

    @field_validator("inject_faults")
    @classmethod
    def _faults_parse(cls, value: list[str]) -> list[str]:
        from src.common.faults import parse_fault  # pure, stdlib only

        for text in value:
            parse_fault(text)  # raises ValueError naming the fault and what is wrong
        return value

    @field_validator("controller_rho_max")
    @classmethod
    def _rho_max_over_min(cls, value: float, info) -> float:
        low = info.data.get("controller_rho_min")
        if low is not None and value < low:
            raise ValueError(f"must be >= system.controller_rho_min ({low})")
        return value

    @field_validator("controller_max_staleness_max")
    @classmethod
    def _staleness_max_over_min(cls, value: int, info) -> int:
        low = info.data.get("controller_max_staleness_min")
        if low is not None and value < low:
            raise ValueError(f"must be >= system.controller_max_staleness_min ({low})")
        return value

    @field_validator("heartbeat_timeout")
    @classmethod
    def _timeout_after_interval(cls, value: float, info) -> float:
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise ValueError(f"must be > system.heartbeat_interval ({interval})")
        return value

    @field_validator("compression_value_dtype")
    @classmethod
    def _values_of_topk(cls, value: str, info) -> str:
        if value != "float32" and info.data.get("compression_type") == "quantization":
            raise ValueError("applies to top-k values; quantization sends codes and float32 scales (leave it float32)")
        return value

    @field_validator("checkpoint_dir", "log_dir")
    @classmethod
    def _non_empty_path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty path")
        return value

    @field_validator("server_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("must be host:port with a port in 0..65535")
        return value

    @field_validator("shard_addresses")
    @classmethod
    def _one_address_per_shard(cls, value: list[str], info) -> list[str]:
        shards = info.data.get("num_servers")
        if value and shards is not None and len(value) != shards:
            raise ValueError(
                f"{len(value)} addresses for system.num_servers = {shards} shards (one each, shard 0 first)"
            )
        for address in value:
            cls._host_port(address)
        return value


# ----------------------------------------------------------------------------- emulation (src/emulation/netem.py)


_EMULATED_BOUNDS: dict[str, dict[str, Any]] = {
    "slowdown": {"ge": 1, "why": "1 = the machine's own speed"},
    "step_delay_s": {"ge": 0},
    "step_delay_sigma": {"ge": 0},
    "uplink_mbps": {"gt": 0, "why": "or null: not limited"},
    "downlink_mbps": {"gt": 0, "why": "or null: not limited"},
    "uplink_latency_ms": {"ge": 0},
    "downlink_latency_ms": {"ge": 0},
    "compute_s": {"ge": 0},
    "compress_s": {"ge": 0},
    "server_update_s": {"ge": 0},
    "server_reply_s": {"ge": 0},
    "server_mbps": {"gt": 0, "why": "or null: not limited"},
    "restart_s": {"ge": 0},
}
"""The bounds of each emulation field, shared by ``emulation`` and its per-worker overrides."""


def _emulated(name: str, default: float | None = None) -> Any:
    return bounded(default, **_EMULATED_BOUNDS[name])


class _EmulationSection(Section):
    # every emulated value is finite; an infinite or NaN one is refused as "must be a finite number"
    model_config = ConfigDict(allow_inf_nan=False)


class WorkerEmulation(_EmulationSection):
    """One worker's conditions in ``emulation.workers``; a field left null takes ``emulation``'s value."""

    slowdown: float | None = _emulated("slowdown")
    step_delay_s: float | None = _emulated("step_delay_s")
    step_delay_sigma: float | None = _emulated("step_delay_sigma")
    uplink_mbps: float | None = _emulated("uplink_mbps")
    downlink_mbps: float | None = _emulated("downlink_mbps")
    uplink_latency_ms: float | None = _emulated("uplink_latency_ms")
    downlink_latency_ms: float | None = _emulated("downlink_latency_ms")
    compute_s: float | None = _emulated("compute_s")


class EmulationConfig(_EmulationSection):
    """Emulated stragglers and slow links of a parameter-server run (:mod:`src.emulation.netem`); the values
    here apply to every worker, ``workers`` overrides them per worker id. All off by default."""

    slowdown: float = _emulated("slowdown", 1.0)
    """Each step's measured compute time is stretched to this many times itself (4 = a 4x slower worker)."""
    step_delay_s: float = _emulated("step_delay_s", 0.0)
    """Seconds added to each step's compute: the median when ``step_delay_sigma`` > 0."""
    step_delay_sigma: float = _emulated("step_delay_sigma", 0.0)
    """Log-normal spread of the added delay (sigma of its log; 0 = the same delay every step)."""
    uplink_mbps: float | None = _emulated("uplink_mbps")
    """Worker -> server bandwidth in Mbit/s (10^6 bit/s); null = not limited."""
    downlink_mbps: float | None = _emulated("downlink_mbps")
    """Server -> worker bandwidth in Mbit/s; null = not limited."""
    uplink_latency_ms: float = _emulated("uplink_latency_ms", 0.0)
    downlink_latency_ms: float = _emulated("downlink_latency_ms", 0.0)
    workers: dict[int, WorkerEmulation] = {}
    """Per worker id: ``{1: {slowdown: 4}}`` makes worker 1 four times slower."""
    # --- the cost model of a virtual-time run (system.clock: virtual; scripts/calibrate.py measures them) ---
    compute_s: float | None = _emulated("compute_s")
    """Virtual time: seconds of one step's forward/backward on one batch of ``training.batch_size``
    (before ``slowdown`` and ``step_delay_s``); per worker in ``workers`` too."""
    compress_s: float | None = _emulated("compress_s")
    """Virtual time: seconds a worker spends on error feedback and compression per push (compressed runs)."""
    server_update_s: float | None = _emulated("server_update_s")
    """Virtual time: the server's seconds per push it takes in (decode, validate, add or apply)."""
    server_reply_s: float | None = _emulated("server_reply_s")
    """Virtual time: the server's seconds per reply it builds (parameters or deltas, serialized)."""
    server_mbps: float | None = _emulated("server_mbps")
    """Virtual time: the server NIC's bandwidth each way in Mbit/s, shared fairly by concurrent transfers;
    null = not limited."""
    restart_s: float | None = _emulated("restart_s")
    """Virtual time: seconds a killed process takes to start again and register (runs with kill/hang faults)."""
    uplink_schedule: list[tuple[float, float]] = []
    """Virtual time: ``[[seconds, mbps], ...]``: from each virtual second on (from the run's start), every
    worker's uplink is that many Mbit/s (a mid-run link change); before the first entry, ``uplink_mbps``
    (or the worker's own). A message takes the rate in force when it starts."""

    layer_split: list[tuple[float, float]] = []
    """Virtual time, ``system.streaming`` or DDP: each layer's ``[forward, backward]`` share of a step's compute, one
    pair per layer in forward order (the modules with tensors of their own: ``scripts/calibrate.py --layers`` prints
    their names and the split it measured on this machine, ready to paste); the pairs are weights (their sum need
    not be 1). Empty: the split comes from the model's shapes (:mod:`src.virtual.layers`), the same on every
    machine."""

    @field_validator("layer_split")
    @classmethod
    def _layer_split(cls, value: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if any(share < 0 for pair in value for share in pair):  # finite already (the sections refuse inf and NaN)
            raise ValueError("every share must be a finite number >= 0")
        if value and not sum(f + b for f, b in value) > 0:
            raise ValueError("the shares must not all be 0")
        return value

    @field_validator("uplink_schedule")
    @classmethod
    def _schedule(cls, value: list[tuple[float, float]]) -> list[tuple[float, float]]:
        times = [t for t, _ in value]  # finite already: the emulation sections refuse inf and NaN
        if any(t < 0 for t in times) or times != sorted(set(times)):
            raise ValueError("the seconds must be finite, >= 0 and strictly increasing")
        if any(mbps <= 0 for _, mbps in value):
            raise ValueError("every Mbit/s must be a finite number > 0")
        return value


# ---------------------------------------------------------------------- metrics sinks (src/telemetry/trackers.py)

TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")


class MetricsConfig(Section):
    """Where a run's metrics go besides ``events.jsonl`` (the source of truth, always written)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    """``tensorboard``: event files in every process's log folder; ``wandb`` / ``mlflow``: one run in
    that tracker per training run, logged by the process that owns the run summary (extras
    ``pip install -e .[wandb]`` / ``.[mlflow]``)."""
    project: str = "distributed-training-system"
    """The W&B project and the MLflow experiment the run goes into."""
    run_name: str | None = None
    """The tracker run's name; null: ``<architecture>-<YYYYmmdd-HHMMSS>``."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow stores runs (``sqlite:///mlflow.db``, ``http://host:5000``); null: $MLFLOW_TRACKING_URI, else
    MLflow's default."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; null: $WANDB_MODE, else wandb's default. Offline runs land in ``<log_dir>/wandb/`` (``wandb sync``
    uploads them)."""

    @field_validator("trackers")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once")
        return value

    @field_validator("project")
    @classmethod
    def _non_empty_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty name")
        return value


class Config(Section):
    """A whole run: ``training`` + ``system`` (+ ``emulation``, off by default; ``metrics``: where metrics go)."""

    training: TrainingConfig = TrainingConfig()
    system: SystemConfig = SystemConfig()
    emulation: EmulationConfig = EmulationConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _streaming_needs_whole_gradients(self) -> "Config":
        system = self.system
        if system.streaming and system.local_steps != 1:
            raise ValueError(
                f"system.streaming: needs system.local_steps 1, got {system.local_steps} (local steps sum several "
                "batches' gradients, so none is ready to send during backward)"
            )
        if system.streaming and self.training.amp == "fp16":
            raise ValueError(
                "system.streaming: not with training.amp fp16 (its gradients are unscaled, and an overflowed batch "
                "computed again, only after backward)"
            )
        if system.pipelined_replies:
            refusal = self._pipelining_refusal()
            if refusal:
                raise ValueError(f"system.pipelined_replies: {refusal}")
        return self

    def _pipelining_refusal(self) -> str | None:
        """Why ``system.pipelined_replies`` cannot run with the rest of this config (``None``: it can)."""
        system, emulation = self.system, self.emulation
        if not system.streaming:
            return "needs system.streaming (the gradients must arrive during backward)"
        if system.aggregation_mode != "sync":
            return "sync only (an async push is applied as it arrives, with nothing to pipeline against)"
        if system.num_servers != 1 and system.transport != "tcp" and system.clock != "virtual":
            return (
                "with several shards, system.transport tcp only (a follower sends a hold's slices after its "
                "acknowledgement, and gRPC's hold call ends with it)"
            )
        if system.downlink_compression != "none":
            return "not with system.downlink_compression (a reply's deltas follow what each worker holds)"
        if system.tls_cert_file and system.transport == "tcp":
            return "not with TLS over system.transport tcp (slices are written while the connection is being read)"
        if system.clock != "virtual" and (emulation.uplink_mbps or emulation.downlink_mbps):
            return "not with emulated links in real time (they delay whole replies, not slices; virtual time has them)"
        return None

    @model_validator(mode="after")
    def _schedule_in_virtual_time(self) -> "Config":
        if self.emulation.uplink_schedule and self.system.clock != "virtual":
            raise ValueError(
                "emulation.uplink_schedule: a mid-run link change is modelled in virtual time only "
                "(system.clock: virtual)"
            )
        system = self.system
        if self.emulation.layer_split and not (
            system.clock == "virtual" and (system.streaming or system.architecture == "ddp")
        ):
            raise ValueError(
                "emulation.layer_split: a step's compute split over its layers is modelled in virtual time only, "
                "for a streamed parameter server or DDP (system.clock: virtual, and system.streaming: true or "
                "system.architecture: ddp)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (stored in checkpoints and summaries)."""
        return self.model_dump(mode="json")


def validate_config(data: Mapping[str, Any]) -> Config:
    """Validate a nested dict; raises :class:`ConfigError` listing every problem."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([describe(error, Config, SECRET_FIELDS) for error in exc.errors()]) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (not yet validated)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read config file ({exc.strerror})"]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError([f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {detail}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping with 'training' and/or 'system'"])
    return data


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _nest(dotted: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in dotted.items():
        nested = _deep_merge(nested, nest_path(key, value))
    return nested


def nest_path(path: str, value: Any) -> dict[str, Any]:
    """``"emulation.workers.1.slowdown", 4`` -> ``{"emulation": {"workers": {1: {"slowdown": 4}}}}``.

    All-digit parts become integer keys, as YAML reads ``1:`` (the ids of ``emulation.workers``).

    Raises:
        ValueError: ``path`` is not ``section.field[.more]`` with non-empty parts.
    """
    parts = path.split(".")
    if len(parts) < 2 or not all(part.strip() for part in parts):
        raise ValueError(f"{path!r} must be a dotted field name, section.field[.key...] (e.g. training.weight_decay)")
    nested: Any = value
    for part in reversed(parts):
        nested = {int(part) if part.isdigit() else part: nested}
    return nested


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    assignments: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated config from runner defaults, a file and CLI overrides.

    Args:
        path: YAML (``.yaml``/``.yml``) or JSON (``.json``) file, or ``None``.
        overrides: dotted keys from command-line flags, e.g. ``{"training.batch_size": 32}``;
            ``None`` values are ignored (a flag that was not given).
        defaults: dotted keys the runner sets below the file, e.g. its output folders.
        assignments: dotted paths of any depth from ``--set``, applied last, in order; ``None`` is
            a value here (``--set training.max_train_samples=null``).

    Raises:
        ConfigError: one line per problem, each naming the dotted field.
    """
    data = _nest({k: v for k, v in (defaults or {}).items() if v is not None})
    if path is not None:
        data = _deep_merge(data, read_config_file(path))
    return config_from_data(data, overrides=overrides, assignments=assignments)


def config_from_data(
    data: Mapping[str, Any], *, overrides: Mapping[str, Any] | None = None, assignments: Mapping[str, Any] | None = None
) -> Config:
    """:func:`load_config` for a config already read (e.g. an experiment file's run sections)."""
    data = _deep_merge(dict(data), _nest({k: v for k, v in (overrides or {}).items() if v is not None}))
    return validate_config(apply_assignments(data, assignments or {}))


def apply_assignments(data: Mapping[str, Any], assignments: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config dict, not yet validated) with each dotted path of ``assignments`` set, in order.

    Raises:
        ConfigError: a path that is not ``section.field[.key...]``.
    """
    merged = dict(data)
    for field, value in assignments.items():
        try:
            merged = _deep_merge(merged, nest_path(field, value))
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
    return merged
