"""Run configuration: the ``training`` and ``system`` sections, validated with pydantic v2.

A config comes from three layers, lowest first: the runner's defaults (its output folders), a YAML
or JSON file (``--config``), then command-line flags. :func:`load_config` merges them and validates
once, so every rule lives here and every error names its dotted field, the bad value and the rule::

    system.compression_ratio: must be in (0, 1], got 1.5

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

DATASET_NAMES = ("mnist", "fashion_mnist", "cifar10", "mnist_5k", "synthetic")
SECRET_FIELDS = ("system.auth_token",)
"""Fields whose values an error message must never show."""


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainingConfig(_Section):
    """What is trained and how: data, model, optimizer, schedule."""

    batch_size: int = 64
    """Samples per step per worker (per rank for DDP)."""
    learning_rate: float = 0.05
    num_epochs: int = 2
    dataset: Literal["mnist", "fashion_mnist", "cifar10", "mnist_5k", "synthetic"] = "mnist_5k"
    """``mnist_5k`` is bundled and works offline; the torchvision sets download into ``data_dir``."""
    model_architecture: str = "simple_cnn"
    """A name from ``src.models.MODELS``."""
    checkpoint_interval: int = 1
    """Epochs between checkpoints (baseline, DDP) or server versions between checkpoints (PS)."""
    checkpoint_interval_steps: int = 0
    """DDP: also checkpoint every this many optimizer steps (mid-epoch too); 0 = epoch checkpoints only."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    data_dir: str = "./data"
    max_train_samples: int | None = None
    """Use only the first N training samples (smoke runs); ``None`` uses all."""
    max_test_samples: int | None = None
    num_samples: int = 2048
    """Training-set size of the ``synthetic`` dataset."""
    eval_batch_size: int = 1000
    eval_interval: int = 0
    """Also evaluate every this many steps (parameter server: server versions); 0 = only at epoch ends."""
    target_accuracy: float | None = None
    """Accuracy in (0, 1] whose first crossing the summary reports as time to target; ``None`` for none."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available, else CPU)."""

    @field_validator("batch_size", "num_epochs", "checkpoint_interval", "num_samples", "eval_batch_size")
    @classmethod
    def _positive_int(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("eval_interval")
    @classmethod
    def _non_negative_interval(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0 = evaluate only at epoch ends)")
        return value

    @field_validator("checkpoint_interval_steps")
    @classmethod
    def _non_negative_steps(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0 = checkpoint only at epoch ends)")
        return value

    @field_validator("target_accuracy")
    @classmethod
    def _accuracy_or_none(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError("must be in (0, 1] (or omitted for no target)")
        return value

    @field_validator("max_train_samples", "max_test_samples")
    @classmethod
    def _positive_or_none(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0 (or omitted for all samples)")
        return value

    @field_validator("learning_rate")
    @classmethod
    def _positive_float(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0")
        return value

    @field_validator("momentum")
    @classmethod
    def _momentum_range(cls, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError("must be in [0, 1)")
        return value

    @field_validator("weight_decay")
    @classmethod
    def _non_negative(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError("must be a finite number >= 0")
        return value

    @field_validator("model_architecture")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from src.models import MODELS  # models sit below config; imported late to keep loading cheap

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


class SystemConfig(_Section):
    """How it is distributed: architecture, workers, compression, fault tolerance, outputs."""

    num_workers: int = 2
    """Parameter-server workers, or DDP world size."""
    architecture: Literal["baseline", "parameter_server", "ddp"] = "parameter_server"
    aggregation_mode: Literal["sync", "async"] = "sync"
    compression_enabled: bool = False
    compression_type: Literal["quantization", "topk"] = "topk"
    compression_ratio: float = 0.01
    """Fraction of entries top-k keeps."""
    quantization_bits: Literal[2, 4, 8] = 8
    quantization_bucket_size: int = 512
    topk_selection: Literal["exact", "sampled"] = "sampled"
    """Same entries either way (sampled corrects its threshold estimate to the exact top-k); sampled is faster."""
    error_feedback: bool = True
    """Keep what compression dropped and add it to the next gradient."""
    warmup_steps: int = 0
    """Uncompressed sends before compression starts."""
    staleness_policy: Literal["none", "soft", "hard", "both"] = "none"
    """Async pushes by Staleness tau: none (full weight), soft (weight 1/(1+beta*tau)), hard (reject tau > S_max), both."""
    staleness_beta: float = 0.5
    """beta of soft attenuation, >= 0."""
    max_staleness: int = 8
    """S_max of the hard bound: an async push with tau > S_max is rejected (the worker rolls back)."""
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    """Seconds of silence after which a worker counts as failed; must exceed the interval."""
    max_restarts: int = 3
    """Restarts a local launcher grants each failed worker (PS) or the DDP group (elastic agent)."""
    inject_faults: list[str] = []
    """Faults to inject on purpose (:mod:`src.faults`), e.g. ``kill:worker=1@step=40``, ``kill:server@version=150``."""
    checkpoint_dir: str = "checkpoints"
    log_dir: str = "logs"
    server_address: str = "127.0.0.1:0"
    """Where the parameter server listens / workers connect; port 0 lets the local launcher pick."""
    auth_token: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Shared secret every RPC carries; ``None`` reads $DTS_AUTH_TOKEN or makes one per local run.

    A secret: excluded from every dump (:meth:`Config.to_dict`, JSON), so it never reaches events,
    checkpoints or summaries, and never echoed in an error message."""
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    allreduce: Literal["default", "ring"] = "default"
    """DDP gradient exchange: the backend's allreduce, or the explicit ring hook."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @field_validator("num_workers", "quantization_bucket_size")
    @classmethod
    def _positive_int(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("inject_faults")
    @classmethod
    def _faults_parse(cls, value: list[str]) -> list[str]:
        from src.faults import parse_fault  # pure, stdlib only

        for text in value:
            parse_fault(text)  # raises ValueError naming the fault and what is wrong
        return value

    @field_validator("staleness_beta")
    @classmethod
    def _beta_non_negative(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError("must be a finite number >= 0")
        return value

    @field_validator("warmup_steps", "max_restarts", "max_staleness")
    @classmethod
    def _non_negative_int(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("compression_ratio")
    @classmethod
    def _ratio_range(cls, value: float) -> float:
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError("must be in (0, 1]")
        return value

    @field_validator("heartbeat_interval")
    @classmethod
    def _interval_positive(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0")
        return value

    @field_validator("heartbeat_timeout")
    @classmethod
    def _timeout_after_interval(cls, value: float, info) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0")
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise ValueError(f"must be > system.heartbeat_interval ({interval})")
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


class Config(_Section):
    """A whole run: ``training`` + ``system``."""

    training: TrainingConfig = TrainingConfig()
    system: SystemConfig = SystemConfig()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (stored in checkpoints and summaries)."""
        return self.model_dump(mode="json")


def _describe(error: Mapping[str, Any]) -> str:
    field = ".".join(str(part) for part in error["loc"]) or "config"
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{field}: unknown key"
    if kind == "missing":
        return f"{field}: required"
    if kind == "value_error":
        rule = str(context.get("error", error["msg"]))
    elif kind == "literal_error":
        rule = f"must be one of {context.get('expected', '')}"
    elif kind.startswith("int_"):
        rule = "must be an integer"
    elif kind.startswith("float_"):
        rule = "must be a number"
    elif kind.startswith("bool_"):
        rule = "must be true or false"
    elif kind.startswith("string_"):
        rule = "must be a string"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        rule = "must be a mapping"
    else:
        rule = error["msg"]
    if field in SECRET_FIELDS:
        return f"{field}: {rule} (value not shown: it is a secret)"
    return f"{field}: {rule}, got {error.get('input')!r}"


def validate_config(data: Mapping[str, Any]) -> Config:
    """Validate a nested dict; raises :class:`ConfigError` listing every problem."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(error) for error in exc.errors()]) from None


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
        section, _, field = key.partition(".")
        if not field:
            raise ValueError(f"override key {key!r} must be 'section.field'")
        nested.setdefault(section, {})[field] = value
    return nested


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated config from runner defaults, a file and CLI overrides.

    Args:
        path: YAML (``.yaml``/``.yml``) or JSON (``.json``) file, or ``None``.
        overrides: dotted keys from command-line flags, e.g. ``{"training.batch_size": 32}``;
            ``None`` values are ignored (a flag that was not given).
        defaults: dotted keys the runner sets below the file, e.g. its output folders.

    Raises:
        ConfigError: one line per problem, each naming the dotted field.
    """
    data = _nest({k: v for k, v in (defaults or {}).items() if v is not None})
    if path is not None:
        data = _deep_merge(data, read_config_file(path))
    data = _deep_merge(data, _nest({k: v for k, v in (overrides or {}).items() if v is not None}))
    return validate_config(data)
