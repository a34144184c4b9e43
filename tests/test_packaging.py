"""The wheel holds the whole tree: built from the repository, installed into a folder of its own and used from a
directory that is not the repository.

pyproject.toml finds the packages (``[tool.setuptools.packages.find]``) rather than listing them; this test is
what holds that: every module of ``src/`` must be in the wheel and import from the installed copy, ``torch_asgc``
must be a top-level package there too (``python -m torch_asgc.server --help``), a runner copied out of the
repository must run against it, and the bundled ``mnist_5k.npz`` (package data) must load. The repository's own
editable install stays on ``sys.path`` in the subprocesses, so a module missing from the wheel would still import,
from the repository: each imported module's ``__file__`` is checked to lie in the install folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# 20 to 50 s on 2 shared cores: building and installing ~10 s, importing every module (torch, grpc, Lightning,
# transformers) most of the rest.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BUILD_TIMEOUT_S = 300
RUN_TIMEOUT_S = 240
UNWANTED = shutil.ignore_patterns("__pycache__", "*.pyc")

# Runs in the subprocess: import each module named in argv[2] (JSON) and say where each came from.
PROBE = """
import importlib, importlib.util, json, sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
modules = json.loads(sys.argv[2])
outside, failed = {}, {}
for name in modules:
    try:
        module = importlib.import_module(name)
    except Exception as error:  # every failure is reported, not just the first
        failed[name] = f"{type(error).__name__}: {error}"
        continue
    if target not in Path(module.__file__).resolve().parents:
        outside[name] = module.__file__
for name in ("torch_asgc", "torch_asgc.server", "torch_asgc.plugins"):
    origin = importlib.util.find_spec(name).origin
    if target not in Path(origin).resolve().parents:
        outside[name] = origin
from src.training.data import BUNDLED_MNIST_5K, load_dataset

train, test = load_dataset("mnist_5k", "train"), load_dataset("mnist_5k", "test")
print(json.dumps({
    "outside": outside,
    "failed": failed,
    "mnist_5k_file": str(BUNDLED_MNIST_5K),
    "mnist_5k_sizes": [len(train), len(test)],
    "image_shape": list(train.images.shape[1:]),
}))
"""


def module_name(relative: Path) -> str:
    """``src/training/data.py`` -> ``src.training.data``; ``src/ps/__init__.py`` -> ``src.ps``."""
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repo_modules() -> set[str]:
    return {module_name(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py") if "__pycache__" not in p.parts}


def wheel_modules(names: list[str], package: str) -> set[str]:
    return {module_name(Path(n)) for n in names if n.split("/")[0] == package and n.endswith(".py")}


def source_copy(destination: Path) -> Path:
    """What a build reads from the repository (its top-level files: pyproject.toml, README.md, any setup file; and
    src/), without build leftovers: pip builds in the source tree (so not in the repository), and a stale build/lib
    would reach the wheel."""
    destination.mkdir()
    for path in ROOT.iterdir():
        if path.is_file():
            shutil.copy2(path, destination / path.name)
    shutil.copytree(ROOT / "src", destination / "src", ignore=UNWANTED)
    return destination


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)}: exit {result.returncode}\n{result.stderr[-3000:]}"
    return result


def test_the_wheel_installs_every_module_of_src_torch_asgc_and_the_data_and_runs_from_elsewhere(tmp_path):
    pip, pip_env = [sys.executable, "-m", "pip"], os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    source = source_copy(tmp_path / "source")
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)]
    run(build, tmp_path, pip_env, BUILD_TIMEOUT_S)
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    expected = repo_modules()
    assert "src.training.data" in expected and "src.torch_asgc.server" in expected  # the walk found the tree
    assert wheel_modules(names, "src") == expected, {
        "missing from the wheel": sorted(expected - wheel_modules(names, "src")),
        "only in the wheel": sorted(wheel_modules(names, "src") - expected),
    }
    library = {"torch_asgc" + m.removeprefix("src.torch_asgc") for m in expected if m.startswith("src.torch_asgc")}
    assert wheel_modules(names, "torch_asgc") == library
    assert {"src/training/assets/mnist_5k.npz", "src/parameter_server_pb2.pyi"} <= set(names)

    install = [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    run(install, tmp_path, pip_env, BUILD_TIMEOUT_S)
    elsewhere.mkdir()
    env = os.environ | {"PYTHONPATH": str(target), "PYTHONDONTWRITEBYTECODE": "1"}
    modules = sorted(expected | library)
    probe = run([sys.executable, "-c", PROBE, str(target), json.dumps(modules)], elsewhere, env, RUN_TIMEOUT_S)
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["failed"] == {}
    assert found["outside"] == {}, f"imported from outside {target}"
    assert Path(found["mnist_5k_file"]).resolve() == (target / "src/training/assets/mnist_5k.npz").resolve()
    assert found["mnist_5k_sizes"] == [4000, 1000] and found["image_shape"] == [1, 28, 28]

    server = run([sys.executable, "-m", "torch_asgc.server", "--help"], elsewhere, env, RUN_TIMEOUT_S)
    assert "usage" in server.stdout.lower() and "--server-address" in server.stdout
    shutil.copy2(ROOT / "run_baseline_training.py", elsewhere / "run_baseline_training.py")
    runner = run([sys.executable, "run_baseline_training.py", "--help"], elsewhere, env, RUN_TIMEOUT_S)
    assert "usage" in runner.stdout.lower() and "--dataset" in runner.stdout
