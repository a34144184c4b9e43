"""Model registry: every model builds for every dataset shape and gives one logit per class."""

from __future__ import annotations

import pytest
import torch

from src.training.data import DATASETS
from src.training.models import MODELS, build_model


@pytest.mark.parametrize("dataset", ["mnist_5k", "cifar10"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_fit_dataset_shapes(name, dataset):
    info = DATASETS[dataset]
    model = build_model(name, info)
    logits = model(torch.randn(2, info.channels, info.height, info.width))
    assert logits.shape == (2, info.num_classes)


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'vgg'.*simple_cnn"):
        build_model("vgg", DATASETS["mnist"])


def test_resnet18_is_cifar_sized():
    parameters = sum(p.numel() for p in build_model("resnet18", DATASETS["cifar10"]).parameters())
    assert 11_000_000 < parameters < 11_300_000  # ~45 MB of float32, the PS size-limit case
