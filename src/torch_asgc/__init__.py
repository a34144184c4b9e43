"""torch_asgc: train your own model, with your own loop, on our gRPC parameter server.

The library wraps a standard ``nn.Module`` and optimizer; it owns neither the training loop, nor the
dataset, nor the loss (like Horovod's ``DistributedOptimizer`` and PyTorch's DDP wrapper)::

    from torch_asgc import connect, DistributedModel, DistributedOptimizer

    with connect("127.0.0.1:50051") as client:                # token: $DTS_AUTH_TOKEN
        model = DistributedModel(net, client)                  # the server's parameters, kept in step
        optimizer = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), client)
        for x, y in loader:                                    # your loop, your data, your loss
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()                                   # compress, push, load the new parameters

Already on ``DistributedDataParallel``? :mod:`torch_asgc.ddp` puts our compressed gradient exchange
(top-k or quantization with error feedback, 16-bit values) or our ring all-reduce on your DDP model
in one call: ``register_compression_hook(ddp_model, "topk", ratio=0.01)``.

The server: ``python -m torch_asgc.server`` (:mod:`torch_asgc.server`). Integrations:
:class:`torch_asgc.plugins.lightning.ASGCStrategy` and
:class:`torch_asgc.plugins.huggingface.ASGCHFTrainerCallback`. Design and measurements:
``docs/library.md``.
"""

from src.compression import build_compressor
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import CompressionPolicy
from src.ps.worker.membership import IncarnationRevoked

from . import ddp
from .client import WorkerClient, connect
from .ddp import register_compression_hook, register_ring_hook
from .model import DistributedModel
from .optim import DistributedOptimizer

__all__ = [
    "CompressionPolicy",
    "DistributedModel",
    "DistributedOptimizer",
    "ErrorFeedback",
    "IncarnationRevoked",
    "WorkerClient",
    "build_compressor",
    "connect",
    "ddp",
    "register_compression_hook",
    "register_ring_hook",
]
