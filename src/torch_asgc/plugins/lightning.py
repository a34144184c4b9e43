"""ASGCStrategy: train a LightningModule on our parameter server with one Trainer argument.

    trainer = pl.Trainer(max_epochs=2, strategy=ASGCStrategy("127.0.0.1:50051"))   # token: $DTS_AUTH_TOKEN
    trainer.fit(lit_module, train_loader)

Each worker process runs its own Trainer on its own data (give each a different shard); the
strategy is Lightning's single-device strategy plus, when fitting starts:

* :func:`~torch_asgc.client.connect` (heartbeats, reconnection),
* :class:`~torch_asgc.model.DistributedModel` over the LightningModule (the server's parameters at
  the start; the first worker's initial values when the server has no model yet),
* :class:`~torch_asgc.optim.DistributedOptimizer` around the optimizer ``configure_optimizers``
  returns (one optimizer), so Lightning's ``optimizer.step(closure)`` pushes the gradient and loads
  the server's reply (with ``precision="16-mixed"`` Lightning calls ``scaler.step(optimizer)``,
  which takes the optimizer's AMP path; tested with GradScaler directly, not through Lightning).
  A learning-rate scheduler ``configure_optimizers`` returns drives that optimizer as usual, and its
  rates reach the server with each push (the server's optimizer steps with them).

Each step's sample count is the training batch's size (Lightning's ``extract_batch_size``). The
client leaves the run (``close()``) when fitting ends. Validation and checkpoints are Lightning's
own, on the local copy of the parameters (the optimizer's state dict includes the error feedback).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import SingleDeviceStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.data import extract_batch_size

from ..client import WorkerClient, connect
from ..model import DistributedModel
from ..optim import DistributedOptimizer


class ASGCStrategy(SingleDeviceStrategy):
    """Lightning strategy that trains through the parameter server at ``address``.

    Args:
        address: the server's ``host:port``.
        token: the run's auth token (default ``$DTS_AUTH_TOKEN``).
        worker_id: this worker's id (default: the server picks a free one).
        compression, error_feedback: as for :class:`~torch_asgc.optim.DistributedOptimizer`.
        device: where the LightningModule runs (default cpu).
        **connect_options: more :func:`~torch_asgc.client.connect` options (``tls_ca_file``, ``connect_timeout_s``).
    """

    strategy_name = "asgc"

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        worker_id: int | None = None,
        compression: Any = None,
        error_feedback: bool = True,
        device: str = "cpu",
        **connect_options: Any,
    ):
        super().__init__(device=device)
        self.address = address
        self._connect = dict(token=token, worker_id=worker_id, **connect_options)
        self._optimizer_options = dict(compression=compression, error_feedback=error_feedback)
        self.client: WorkerClient | None = None
        self.distributed_model: DistributedModel | None = None

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"ASGCStrategy trains with one optimizer; configure_optimizers returned {len(self.optimizers)}"
            )
        self.client = connect(self.address, **self._connect)
        try:
            self.distributed_model = DistributedModel(self.lightning_module, self.client, count_samples=False)
            self.optimizers = [DistributedOptimizer(self.optimizers[0], self.client, **self._optimizer_options)]
        except BaseException:
            self.client.close()
            raise

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.distributed_model is not None:
            batch = args[0] if args else kwargs.get("batch")
            self.distributed_model.add_samples(extract_batch_size(batch))
        return super().training_step(*args, **kwargs)

    def teardown(self) -> None:
        client, self.client = self.client, None
        if self.distributed_model is not None:
            self.distributed_model.remove_hooks()
            self.distributed_model = None
        try:
            if client is not None:
                client.close()
        finally:
            super().teardown()
