from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("rank", "num_shards")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_shards: int
    def __init__(self, rank: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "shard", "version", "run_config_json", "parameter_specs", "buffer_specs", "parameters", "buffers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SPECS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SPECS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    shard: Shard
    version: int
    run_config_json: str
    parameter_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buffer_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    parameters: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., version: _Optional[int] = ..., run_config_json: _Optional[str] = ..., parameter_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buffer_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., parameters: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "min_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    min_version: int
    def __init__(self, worker_id: _Optional[int] = ..., min_version: _Optional[int] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("version", "parameters", "buffers", "finished")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    version: int
    parameters: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    finished: bool
    def __init__(self, version: _Optional[int] = ..., parameters: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ..., finished: _Optional[bool] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("epoch", "step", "loss", "correct", "last_in_epoch")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    LAST_IN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    loss: float
    correct: int
    last_in_epoch: bool
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., correct: _Optional[int] = ..., last_in_epoch: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "base_version", "request_id", "num_samples", "gradients", "buffers", "metrics")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    base_version: int
    request_id: int
    num_samples: int
    gradients: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    metrics: StepMetrics
    def __init__(self, worker_id: _Optional[int] = ..., base_version: _Optional[int] = ..., request_id: _Optional[int] = ..., num_samples: _Optional[int] = ..., gradients: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "version", "staleness")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    version: int
    staleness: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("samples", "steps", "bytes_sent", "bytes_received", "gradient_time_s", "compression_time_s", "communication_time_s", "total_time_s", "train_loss", "train_accuracy", "pushes_rejected")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    samples: int
    steps: int
    bytes_sent: int
    bytes_received: int
    gradient_time_s: float
    compression_time_s: float
    communication_time_s: float
    total_time_s: float
    train_loss: float
    train_accuracy: float
    pushes_rejected: int
    def __init__(self, samples: _Optional[int] = ..., steps: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., gradient_time_s: _Optional[float] = ..., compression_time_s: _Optional[float] = ..., communication_time_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., train_loss: _Optional[float] = ..., train_accuracy: _Optional[float] = ..., pushes_rejected: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[int] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "aggregation_mode", "num_workers", "registered", "finished", "pushes_applied", "pushes_rejected", "pushes_refused", "done")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    version: int
    aggregation_mode: str
    num_workers: int
    registered: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedScalarFieldContainer[int]
    pushes_applied: int
    pushes_rejected: int
    pushes_refused: int
    done: bool
    def __init__(self, version: _Optional[int] = ..., aggregation_mode: _Optional[str] = ..., num_workers: _Optional[int] = ..., registered: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[int]] = ..., pushes_applied: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., pushes_refused: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
