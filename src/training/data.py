"""Datasets held in memory as tensors, and the deterministic sharding of an epoch's sample indices.

Datasets: ``mnist``, ``fashion_mnist`` and ``cifar10`` through torchvision under ``data_dir``
(downloaded when online); ``mnist_5k``, 5,000 real MNIST digits bundled in ``src/training/assets`` (works
offline, 4,000 train / 1,000 test, class-balanced); ``synthetic``, seeded class prototypes plus noise
(learnable, any size). Every dataset is loaded once into normalized float tensors, so a batch is an
index lookup, not a DataLoader pipeline: the models here are small and Python-side loading would
dominate a step on two cores.

Sharding: an epoch is a seeded permutation of sample indices; worker ``k`` of ``N`` owns positions
``k, k+N, k+2N, ...``. Shards are disjoint, cover the epoch, and step ``i`` of all workers together
reads exactly positions ``i*N*b .. (i+1)*N*b`` of the permutation: the same samples a single process
with batch ``N*b`` reads at its step ``i``. A :class:`Shard` is a plain list of indices with an owner,
the unit a coordinator can hand to another worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from src.common.seeds import derive_seed

BUNDLED_MNIST_5K = Path(__file__).resolve().parent / "assets" / "mnist_5k.npz"


class DatasetUnavailableError(RuntimeError):
    """The dataset's files are missing and could not be downloaded."""


@dataclass(frozen=True)
class DatasetInfo:
    """Shape and normalization of a dataset's samples (what a model is sized from)."""

    name: str
    channels: int
    height: int
    width: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


_MNIST_STATS = dict(channels=1, height=28, width=28, num_classes=10, mean=(0.1307,), std=(0.3081,))
DATASETS: dict[str, DatasetInfo] = {
    "mnist": DatasetInfo("mnist", **_MNIST_STATS),
    "mnist_5k": DatasetInfo("mnist_5k", **_MNIST_STATS),
    "fashion_mnist": DatasetInfo(
        "fashion_mnist", channels=1, height=28, width=28, num_classes=10, mean=(0.2860,), std=(0.3530,)
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        channels=3,
        height=32,
        width=32,
        num_classes=10,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
    "synthetic": DatasetInfo("synthetic", channels=1, height=28, width=28, num_classes=10, mean=(0.0,), std=(1.0,)),
}


@dataclass
class TensorDataset:
    """Normalized images ``[N, C, H, W]`` (float32) and labels ``[N]`` (int64)."""

    info: DatasetInfo
    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices``, in that order."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images.index_select(0, index), self.labels.index_select(0, index)


def dataset_info(name: str) -> DatasetInfo:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})") from None


def _normalize(info: DatasetInfo, images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W]`` or ``[N, C, H, W]`` -> normalized float32 ``[N, C, H, W]``."""
    images = images_uint8.to(torch.float32).div_(255.0)
    if images.dim() == 3:
        images = images.unsqueeze(1)
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    return images.sub_(mean).div_(std)


def _load_mnist_5k(info: DatasetInfo, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(BUNDLED_MNIST_5K) as arrays:
        images = torch.from_numpy(arrays[f"{split}_images"].copy())
        labels = torch.from_numpy(arrays[f"{split}_labels"].astype(np.int64))
    return images, labels


_TORCHVISION_CLASSES = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}


def _load_torchvision(info: DatasetInfo, split: str, data_dir: str, download: bool):
    import torchvision.datasets as tv

    cls = getattr(tv, _TORCHVISION_CLASSES[info.name])
    train = split == "train"
    if info.name in ("mnist", "fashion_mnist"):
        # Read one split's idx files directly when they are there: torchvision's class insists on
        # all four files even to evaluate on the test split.
        from torchvision.datasets.mnist import read_image_file, read_label_file

        raw = Path(data_dir) / cls.__name__ / "raw"
        prefix = "train" if train else "t10k"
        images_file, labels_file = raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"
        if images_file.is_file() and labels_file.is_file():
            return read_image_file(str(images_file)), read_label_file(str(labels_file)).long()
    if info.name == "cifar10":
        # The same for CIFAR-10's python batches (torchvision's class wants every file with its official MD5).
        folder = Path(data_dir) / "cifar-10-batches-py"
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        if all((folder / name).is_file() for name in names):
            return _read_cifar_batches([folder / name for name in names])
    try:
        dataset = cls(root=data_dir, train=train, download=False)
    except RuntimeError:
        if not download:
            raise DatasetUnavailableError(_missing_message(info, data_dir)) from None
        try:
            dataset = cls(root=data_dir, train=train, download=True)
        except Exception as exc:  # network errors come in many types
            raise DatasetUnavailableError(
                f"{_missing_message(info, data_dir)} (download failed: {type(exc).__name__})"
            ) from None
    data = dataset.data
    images = torch.from_numpy(data).permute(0, 3, 1, 2).contiguous() if isinstance(data, np.ndarray) else data
    labels = torch.as_tensor(dataset.targets, dtype=torch.long)
    return images, labels


def _read_cifar_batches(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's python batches (pickled dicts of ``data``: N x 3072 uint8, ``labels``) as ``[N, 3, 32, 32]`` uint8."""
    import pickle

    images, labels = [], []
    for path in paths:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="latin1")  # the dataset's own format, read from the user's data_dir
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(batch["labels"])
    return torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.long)


def _missing_message(info: DatasetInfo, data_dir: str) -> str:
    folder = {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw", "cifar10": "cifar-10-batches-py"}[info.name]
    return (
        f"dataset {info.name!r} not found under {Path(data_dir) / folder} and it could not be downloaded; "
        f"put torchvision's files there (or run once online), or use --dataset mnist_5k, "
        f"which is bundled and works offline"
    )


def _synthetic(info: DatasetInfo, split: str, num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class prototypes (fixed by ``seed``) plus per-sample noise; test samples use other noise."""
    prototypes_gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(info.num_classes, info.channels, info.height, info.width, generator=prototypes_gen)
    count = num_samples if split == "train" else max(num_samples // 4, info.num_classes)
    noise_gen = torch.Generator().manual_seed(seed * 2 + (1 if split == "train" else 2))
    labels = torch.randint(0, info.num_classes, (count,), generator=noise_gen)
    images = prototypes[labels] + 1.5 * torch.randn(count, info.channels, info.height, info.width, generator=noise_gen)
    return images, labels


def load_dataset(
    name: str,
    split: str,
    *,
    data_dir: str = "./data",
    max_samples: int | None = None,
    num_samples: int = 2048,
    seed: int = 0,
    download: bool = True,
) -> TensorDataset:
    """Load ``split`` (``train`` or ``test``) of dataset ``name`` into memory.

    Args:
        max_samples: keep only the first N samples.
        num_samples: training-set size of ``synthetic`` (its test set is a quarter of it).
        seed: seeds ``synthetic``; the others are fixed data.

    Raises:
        ValueError: unknown dataset or split.
        DatasetUnavailableError: files missing and not downloadable, with where to put them.
    """
    info = dataset_info(name)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name == "synthetic":
        images, labels = _synthetic(info, split, num_samples, seed)
    else:
        if name == "mnist_5k":
            raw, labels = _load_mnist_5k(info, split)
        else:
            raw, labels = _load_torchvision(info, split, data_dir, download)
        if max_samples is not None:
            raw, labels = raw[:max_samples], labels[:max_samples]
        images = _normalize(info, raw)
    if max_samples is not None:
        images, labels = images[:max_samples], labels[:max_samples]
    return TensorDataset(info=info, images=images.contiguous(), labels=labels.contiguous())


# ----------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class Shard:
    """The sample indices one worker owns in one epoch, in the order it reads them."""

    owner: int
    epoch: int
    indices: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indices)

    def batches(self, batch_size: int) -> Iterator[list[int]]:
        """Consecutive batches of ``batch_size`` indices (the last one may be shorter)."""
        for start in range(0, len(self.indices), batch_size):
            yield self.indices[start : start + batch_size]


def check_dataset(training: Any) -> None:
    """Make sure both splits of a config's ``training`` section's dataset load: downloading it once, here, when
    online, rather than in every process of the run at the same time.

    Raises:
        DatasetUnavailableError: its files are missing and cannot be downloaded (the message says where to put
            them).
    """
    for split in ("train", "test"):
        load_dataset(
            training.dataset,
            split,
            data_dir=training.data_dir,
            max_samples=1,
            num_samples=training.num_samples,
            seed=training.seed,
        )


def epoch_permutation(num_samples: int, epoch: int, seed: int) -> list[int]:
    """The order of sample indices in ``epoch``: a permutation fixed by ``(seed, epoch)``."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


def make_shards(num_samples: int, num_workers: int, epoch: int, seed: int) -> list[Shard]:
    """Partition ``epoch``'s permutation among ``num_workers``: worker k owns positions k, k+N, ...

    Shards are disjoint, together cover ``range(num_samples)``, and differ in size by at most one.
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    order = epoch_permutation(num_samples, epoch, seed)
    return [Shard(owner=k, epoch=epoch, indices=order[k::num_workers]) for k in range(num_workers)]


def steps_per_epoch(num_samples: int, num_workers: int, batch_size: int) -> int:
    """Steps every worker takes per epoch, so that synchronous workers stay in lock-step.

    The largest shard decides; a worker whose shard runs out first takes an empty step.
    """
    largest = -(-num_samples // num_workers)
    return -(-largest // batch_size)
