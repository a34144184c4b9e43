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

class Caller(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session: bytes
    def __init__(self, worker_id: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "last_request_id", "carried_batch_ids", "pid", "any_worker_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CARRIED_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ANY_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    last_request_id: int
    carried_batch_ids: _containers.RepeatedScalarFieldContainer[int]
    pid: int
    any_worker_id: bool
    def __init__(self, worker_id: _Optional[int] = ..., last_request_id: _Optional[int] = ..., carried_batch_ids: _Optional[_Iterable[int]] = ..., pid: _Optional[int] = ..., any_worker_id: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "incarnation", "session", "version", "run_config_json", "parameter_specs", "buffer_specs", "last_request_applied", "model_wanted")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SPECS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SPECS_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    MODEL_WANTED_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    incarnation: int
    session: bytes
    version: int
    run_config_json: str
    parameter_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buffer_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    last_request_applied: bool
    model_wanted: bool
    def __init__(self, worker_id: _Optional[int] = ..., incarnation: _Optional[int] = ..., session: _Optional[bytes] = ..., version: _Optional[int] = ..., run_config_json: _Optional[str] = ..., parameter_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buffer_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., last_request_applied: _Optional[bool] = ..., model_wanted: _Optional[bool] = ...) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("caller", "parameter_specs", "buffer_specs", "parameters", "buffers")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SPECS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SPECS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    parameter_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buffer_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    parameters: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., parameter_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buffer_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., parameters: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ...) -> None: ...

class InitializeReply(_message.Message):
    __slots__ = ("accepted", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "epoch", "indices")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    epoch: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., epoch: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class Work(_message.Message):
    __slots__ = ("batches", "finished", "flush")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    finished: bool
    flush: bool
    def __init__(self, batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., finished: _Optional[bool] = ..., flush: _Optional[bool] = ...) -> None: ...

class Control(_message.Message):
    __slots__ = ("compression_ratio", "max_staleness")
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    compression_ratio: float
    max_staleness: int
    def __init__(self, compression_ratio: _Optional[float] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("caller", "certificate", "parameters_only", "final")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_ONLY_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    certificate: bytes
    parameters_only: bool
    final: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., certificate: _Optional[bytes] = ..., parameters_only: _Optional[bool] = ..., final: _Optional[bool] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("version", "parameters", "buffers", "work", "control", "certificate", "provisional")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    parameters: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    work: Work
    control: Control
    certificate: bytes
    provisional: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., parameters: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ..., work: _Optional[_Union[Work, _Mapping]] = ..., control: _Optional[_Union[Control, _Mapping]] = ..., certificate: _Optional[bytes] = ..., provisional: _Optional[_Iterable[int]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("epoch", "step", "loss", "correct", "gradient_time_s", "compression_time_s", "communication_time_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_TIME_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    loss: float
    correct: int
    gradient_time_s: float
    compression_time_s: float
    communication_time_s: float
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., correct: _Optional[int] = ..., gradient_time_s: _Optional[float] = ..., compression_time_s: _Optional[float] = ..., communication_time_s: _Optional[float] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("caller", "base_version", "request_id", "num_samples", "batch_ids", "gradients", "buffers", "metrics", "learning_rate", "hold", "commit", "shard_staleness")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SHARD_STALENESS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    base_version: int
    request_id: int
    num_samples: int
    batch_ids: _containers.RepeatedScalarFieldContainer[int]
    gradients: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    metrics: StepMetrics
    learning_rate: float
    hold: bool
    commit: bool
    shard_staleness: _containers.RepeatedCompositeFieldContainer[ShardStaleness]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., base_version: _Optional[int] = ..., request_id: _Optional[int] = ..., num_samples: _Optional[int] = ..., batch_ids: _Optional[_Iterable[int]] = ..., gradients: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., learning_rate: _Optional[float] = ..., hold: _Optional[bool] = ..., commit: _Optional[bool] = ..., shard_staleness: _Optional[_Iterable[_Union[ShardStaleness, _Mapping]]] = ...) -> None: ...

class PushStreamRequest(_message.Message):
    __slots__ = ("part", "push", "part_more", "part_size")
    PART_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PART_MORE_FIELD_NUMBER: _ClassVar[int]
    PART_SIZE_FIELD_NUMBER: _ClassVar[int]
    part: bytes
    push: bytes
    part_more: bytes
    part_size: int
    def __init__(self, part: _Optional[bytes] = ..., push: _Optional[bytes] = ..., part_more: _Optional[bytes] = ..., part_size: _Optional[int] = ...) -> None: ...

class PushStreamReply(_message.Message):
    __slots__ = ("reply_size", "reply", "provisional")
    REPLY_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    reply_size: int
    reply: bytes
    provisional: bytes
    def __init__(self, reply_size: _Optional[int] = ..., reply: _Optional[bytes] = ..., provisional: _Optional[bytes] = ...) -> None: ...

class ShardStaleness(_message.Message):
    __slots__ = ("shard", "staleness")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    staleness: int
    def __init__(self, shard: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "version", "staleness", "weight", "parameters", "buffers", "parameter_deltas", "work", "control", "certificate", "provisional", "rolled_back")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_DELTAS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    version: int
    staleness: int
    weight: float
    parameters: _containers.RepeatedScalarFieldContainer[bytes]
    buffers: _containers.RepeatedScalarFieldContainer[bytes]
    parameter_deltas: _containers.RepeatedScalarFieldContainer[bytes]
    work: Work
    control: Control
    certificate: bytes
    provisional: _containers.RepeatedScalarFieldContainer[int]
    rolled_back: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., weight: _Optional[float] = ..., parameters: _Optional[_Iterable[bytes]] = ..., buffers: _Optional[_Iterable[bytes]] = ..., parameter_deltas: _Optional[_Iterable[bytes]] = ..., work: _Optional[_Union[Work, _Mapping]] = ..., control: _Optional[_Union[Control, _Mapping]] = ..., certificate: _Optional[bytes] = ..., provisional: _Optional[_Iterable[int]] = ..., rolled_back: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("samples", "steps", "bytes_sent", "bytes_received", "gradient_time_s", "compression_time_s", "communication_time_s", "total_time_s", "train_loss", "train_accuracy", "pushes_rejected", "payload_bytes", "dense_bytes", "emulated_delay_s")
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
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMULATED_DELAY_S_FIELD_NUMBER: _ClassVar[int]
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
    payload_bytes: int
    dense_bytes: int
    emulated_delay_s: float
    def __init__(self, samples: _Optional[int] = ..., steps: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., gradient_time_s: _Optional[float] = ..., compression_time_s: _Optional[float] = ..., communication_time_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., train_loss: _Optional[float] = ..., train_accuracy: _Optional[float] = ..., pushes_rejected: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., dense_bytes: _Optional[int] = ..., emulated_delay_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("caller", "stats")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    stats: WorkerStats
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("caller", "stats")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    stats: WorkerStats
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker_id", "incarnation", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    incarnation: int
    state: str
    def __init__(self, worker_id: _Optional[int] = ..., incarnation: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "aggregation_mode", "num_workers", "registered", "finished", "pushes_applied", "pushes_rejected", "pushes_refused", "done", "workers", "epochs_done", "load", "checkpoints", "resume_version", "instance", "agreed_instances")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_DONE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RESUME_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    AGREED_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    aggregation_mode: str
    num_workers: int
    registered: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedScalarFieldContainer[int]
    pushes_applied: int
    pushes_rejected: int
    pushes_refused: int
    done: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    epochs_done: int
    load: ShardLoad
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    resume_version: int
    instance: bytes
    agreed_instances: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[int] = ..., aggregation_mode: _Optional[str] = ..., num_workers: _Optional[int] = ..., registered: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[int]] = ..., pushes_applied: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., pushes_refused: _Optional[int] = ..., done: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., epochs_done: _Optional[int] = ..., load: _Optional[_Union[ShardLoad, _Mapping]] = ..., checkpoints: _Optional[_Iterable[int]] = ..., resume_version: _Optional[int] = ..., instance: _Optional[bytes] = ..., agreed_instances: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ShardLoad(_message.Message):
    __slots__ = ("bytes_in", "bytes_out", "update_s", "slices_sent", "slices_confirmed", "slices_voided", "tensors_omitted", "rolled_back")
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_S_FIELD_NUMBER: _ClassVar[int]
    SLICES_SENT_FIELD_NUMBER: _ClassVar[int]
    SLICES_CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    SLICES_VOIDED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    bytes_in: int
    bytes_out: int
    update_s: float
    slices_sent: int
    slices_confirmed: int
    slices_voided: int
    tensors_omitted: int
    rolled_back: int
    def __init__(self, bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., update_s: _Optional[float] = ..., slices_sent: _Optional[int] = ..., slices_confirmed: _Optional[int] = ..., slices_voided: _Optional[int] = ..., tensors_omitted: _Optional[int] = ..., rolled_back: _Optional[int] = ...) -> None: ...
