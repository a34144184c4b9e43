"""The model a parameter server serves: none until installed (its own, a worker's, or a checkpoint's).

Once installed: its parameters and optimizer (:class:`~src.ps.state.aggregation.ModelState`), its layout
(what pushes are checked against), its downlink (dense or delta replies, per worker) and the replies
made from it; and the message limit sized from it (fixed once a transport serves).
"""

from __future__ import annotations

import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.config import Config
from src.ps.state.aggregation import ModelState
from src.ps.state.decoding import ModelLayout
from src.ps.state.downlink import Downlink, compressor_from_config
from src.ps.state.model_sources import model_from_layout
from src.ps.state.replies import Replies
from src.ps.state.staleness import server_optimizer
from src.transport.errors import Refused
from src.transport.wire import Received

MODELLESS_MAX_MESSAGE_BYTES = 1 << 30
"""Message limit of a server that starts without a model (it cannot size the limit from the model)."""


class ServedModel:
    """The served model's slot (see the module docstring); ``reply_views``: replies are views of its tensors."""

    def __init__(self, config: Config, *, reply_views: bool):
        self.config = config
        self.reply_views = reply_views
        self.state: ModelState | None = None
        self.layout: ModelLayout | None = None
        self.param_specs: list[pb.TensorSpec] = []
        self.buffer_specs: list[pb.TensorSpec] = []
        self.downlink = Downlink([], None, refresh_interval=1, drift_bound=1.0)  # replaced with the model
        self.replies: Replies | None = None
        self.max_message_bytes = MODELLESS_MAX_MESSAGE_BYTES
        self.serving = False  # once a transport serves, the message limit is fixed

    @property
    def version(self) -> int:
        """The Server Version: optimizer steps taken (0 while there is no model yet)."""
        return self.state.version if self.state is not None else 0

    def warm_up(self) -> None:
        """Make a first optimizer now: the first of a process costs seconds (lazy imports), not later, under a lock."""
        server_optimizer(self.config, [nn.Parameter(torch.zeros(1))])

    def install(self, model: nn.Module) -> None:
        """Serve ``model``: its optimizer, layout, downlink and replies."""
        system = self.config.system
        self.state = ModelState(model, server_optimizer(self.config, model.parameters()))
        self.layout = ModelLayout(self.state)
        self.param_specs, self.buffer_specs = self.layout.param_specs, self.layout.buffer_specs
        self.downlink = Downlink(
            self.state.sent(),
            compressor_from_config(system),
            refresh_interval=system.downlink_refresh_interval,
            drift_bound=system.downlink_drift_bound,
        )
        self.replies = Replies(self.state, self.downlink, views=self.reply_views)
        if not self.serving:
            model_bytes = 4 * sum(p.numel() for p in self.state.params + self.state.buffers)
            # A push is at most ~2x the model (top-k at ratio 1 sends value + index per entry).
            self.max_message_bytes = min(3 * model_bytes + (4 << 20), 2**31 - 1)

    def require(self) -> None:
        """Refuse the call while the server has no model yet."""
        if self.state is None:
            raise Refused("FAILED_PRECONDITION", "the server has no model yet: send Initialize first")

    def offered(self, worker_id: int, received: Received) -> nn.Module | None:
        """The model a worker's Initialize offers, to install; ``None``: the server has one already (which matches)."""
        request = received.message
        layout = (
            [(s.name, tuple(s.shape)) for s in request.parameter_specs],
            [(s.name, tuple(s.shape)) for s in request.buffer_specs],
        )
        if self.state is not None:  # another worker's model came first, or the server has its own
            mismatch = self.layout.mismatch(layout)
            if mismatch:
                raise Refused(
                    "FAILED_PRECONDITION", f"worker {worker_id}: its model does not match the server's: {mismatch}"
                )
            return None
        try:
            return model_from_layout(*layout, received.large["parameters"], received.large["buffers"])
        except ValueError as exc:
            raise Refused("INVALID_ARGUMENT", f"initialize: {exc}") from None
