"""Model registry: ``training.model_architecture`` names a builder; the dataset sizes it.

Every builder takes the dataset's :class:`~src.training.data.DatasetInfo`-like shape (channels, height, width,
number of classes) so the same name works on MNIST (1x28x28) and CIFAR-10 (3x32x32). Add a model by
writing a builder and putting it in :data:`MODELS`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn


class InputShape(Protocol):
    channels: int
    height: int
    width: int
    num_classes: int


class SimpleCNN(nn.Module):
    """Two conv blocks and two linear layers: the MNIST-size default (~0.4M parameters at 28x28)."""

    def __init__(self, channels: int, height: int, width: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        flat = 64 * (height // 4) * (width // 4)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _simple_cnn(shape: InputShape) -> nn.Module:
    return SimpleCNN(shape.channels, shape.height, shape.width, shape.num_classes)


def _mlp(shape: InputShape) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(shape.channels * shape.height * shape.width, 256),
        nn.ReLU(inplace=True),
        nn.Linear(256, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, shape.num_classes),
    )


def _wide_mlp(shape: InputShape) -> nn.Module:
    """~5.8M parameters at 28x28 (23 MB of float32, a resnet18's payload order): a model where communication
    dominates a step's time (its forward/backward is a few milliseconds)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(shape.channels * shape.height * shape.width, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, 640),
        nn.ReLU(inplace=True),
        nn.Linear(640, shape.num_classes),
    )


def _resnet18(shape: InputShape) -> nn.Module:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=shape.num_classes)
    # CIFAR-size inputs: a 3x3 stride-1 stem and no max-pool keep the 32x32 resolution useful.
    model.conv1 = nn.Conv2d(shape.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[InputShape], nn.Module]] = {
    "simple_cnn": _simple_cnn,
    "mlp": _mlp,
    "wide_mlp": _wide_mlp,
    "resnet18": _resnet18,
}


def build_model(name: str, shape: InputShape) -> nn.Module:
    """Build model ``name`` sized for ``shape``.

    Raises:
        ValueError: unknown name.
    """
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})") from None
    return builder(shape)
