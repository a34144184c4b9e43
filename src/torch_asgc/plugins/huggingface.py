"""ASGCHFTrainerCallback: train a Hugging Face model with ``transformers.Trainer`` on our parameter server.

    trainer = Trainer(model=model, args=args, train_dataset=train_set,
                      callbacks=[ASGCHFTrainerCallback("127.0.0.1:50051")])     # token: $DTS_AUTH_TOKEN
    trainer.train()

Each worker process runs its own Trainer on its own data. When training begins the callback
connects (:func:`~torch_asgc.client.connect`), wraps the model in a
:class:`~torch_asgc.model.DistributedModel` (the server's parameters from the start; the first
worker's initial values when the server has none yet; each step's sample count is the batch size of
the model's training forwards, e.g. ``input_ids`` or ``pixel_values``) and puts a
:class:`~torch_asgc.optim.DistributedOptimizer` inside the Trainer's (accelerate-prepared)
optimizer, so the Trainer's ``optimizer.step()`` pushes the gradient (after its gradient clipping)
and loads the server's reply. The server's optimizer applies, not the Trainer's (AdamW); the
Trainer's learning rate and schedule do (``learning_rate``, ``lr_scheduler_type``, warm-up): its
scheduler drives the wrapped optimizer, whose rate goes with each push and is the one the server
steps with. When training ends the client leaves the run.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..client import WorkerClient, connect
from ..model import DistributedModel
from ..optim import DistributedOptimizer


class ASGCHFTrainerCallback(TrainerCallback):
    """Trainer callback that trains through the parameter server at ``address``.

    Args:
        address: the server's ``host:port``.
        token: the run's auth token (default ``$DTS_AUTH_TOKEN``).
        worker_id: this worker's id (default: the server picks a free one).
        compression, error_feedback: as for :class:`~torch_asgc.optim.DistributedOptimizer`.
        **connect_options: more :func:`~torch_asgc.client.connect` options (``tls_ca_file``, ``connect_timeout_s``).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        worker_id: int | None = None,
        compression: Any = None,
        error_feedback: bool = True,
        **connect_options: Any,
    ):
        self.address = address
        self._connect = dict(token=token, worker_id=worker_id, **connect_options)
        self._optimizer_options = dict(compression=compression, error_feedback=error_feedback)
        self.client: WorkerClient | None = None
        self.distributed_model: DistributedModel | None = None
        self.optimizer: DistributedOptimizer | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the torch optimizer
        if model is None or inner is None:
            raise ValueError("ASGCHFTrainerCallback needs the Trainer's model and its accelerate-prepared optimizer")
        self.client = connect(self.address, **self._connect)
        try:
            self.distributed_model = DistributedModel(model, self.client)
            self.optimizer = DistributedOptimizer(inner, self.client, **self._optimizer_options)
        except BaseException:
            self.client.close()
            raise
        optimizer.optimizer = self.optimizer
        if getattr(optimizer, "scaler", None) is not None:  # fp16: accelerate steps a patched copy of the step method
            from accelerate.optimizer import patch_optimizer_step

            optimizer._optimizer_original_step_method = self.optimizer.step
            optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, self.optimizer.step)

    def on_train_end(self, args, state, control, **kwargs):
        client, self.client = self.client, None
        if self.distributed_model is not None:
            self.distributed_model.remove_hooks()
        if client is not None:
            client.close()
