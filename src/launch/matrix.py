"""Run a grid of experiments: every combination of the axes' levels, resumable, one line per run.

    python scripts/run_matrix.py --config configs/matrix_cifar_full.yaml      # the CIFAR-10 evaluation matrix
    python scripts/run_matrix.py --config configs/experiments/matrix_smoke.yaml
    python scripts/run_matrix.py --config configs/experiments/f1_stragglers.yaml --results-dir results
    python scripts/run_matrix.py --config FILE --list          # print the runs, run nothing
    python scripts/run_matrix.py --config FILE --threads 1     # torch single-threaded, as the findings' records
    python scripts/run_matrix.py --config FILE --set training.data_dir=DIR --set matrix.axes.seed=[0]

A matrix file holds a base experiment and the axes to vary::

    matrix:
      name: f1                        # runs go to <results-dir>/<name>/<run>/
      axes:
        mode: [sync, async]                               # system.aggregation_mode
        compression: [identity, topk, topk_ef, quantization]
        controller: [off, on]                             # system.adaptive_compression
        uplink_mbps: [null, 250]                          # emulation.uplink_mbps (null: not limited)
        downlink_mbps: [null]                             # emulation.downlink_mbps
        heterogeneity:                                    # any axis given as a mapping:
          even: {}                                        #   level name -> dotted overrides
          one_4x_slower: {emulation.workers: {1: {slowdown: 4}}}
        seed: [0, 1, 2]                                   # training.seed
        clock: [real, virtual]                            # system.clock (virtual: src/virtual/run.py)
        architecture: [parameter_server, ddp]             # system.architecture
        transport: [grpc, tcp]                            # system.transport (parameter server)
    training: {...}                   # the base experiment: a run config (see run_experiment.py)
    system: {...}
    emulation: {...}

Compression levels: ``identity`` (off), ``topk`` (top-k without error feedback), ``topk_ef`` (top-k
with error feedback), ``quantization`` (QSGD at ``system.quantization_bits``); top-k keeps the base's
``system.compression_ratio``. Axes are expanded in the order written, the last varying fastest.

``--set FIELD=VALUE`` (repeatable, the value read as YAML) sets a field of the matrix file before it is
expanded: the base experiment's (``training.data_dir=DIR``) or the matrix's own (``matrix.axes.seed=[0]``);
an axis level's overrides still win over the base's.

Resumable: a run whose folder holds a finished summary is skipped; a run that was interrupted (its
folder exists without one) is removed and redone. Every run's config is checked before the first
one starts, so a bad level (or ``controller: on`` without evaluations, or in DDP without top-k)
fails at once with one line; so does a dataset whose files are missing (each dataset the runs use is
looked for, and downloaded when online, before the first run: one ``error:`` line saying where to put
them, exit status 1; ``--list`` needs no data). Exit status: 0 all runs finished, 1 some run failed (the
others still ran) or a dataset is missing, 2 a bad matrix file.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from src.config import Config, ConfigError, apply_assignments, read_config_file
from src.launch import experiment as rx
from src.launch.cli import parse_assignment
from src.reports.results import PLOTS_FOLDER

COMPRESSION_LEVELS: dict[str, dict[str, Any]] = {
    "identity": {"system.compression_enabled": False},
    "topk": {"system.compression_enabled": True, "system.compression_type": "topk", "system.error_feedback": False},
    "topk_ef": {"system.compression_enabled": True, "system.compression_type": "topk", "system.error_feedback": True},
    "quantization": {"system.compression_enabled": True, "system.compression_type": "quantization"},
}


def _compression(level: Any) -> tuple[str, dict[str, Any]]:
    if level not in COMPRESSION_LEVELS:
        raise rx.ExperimentError(
            f"matrix.axes.compression: unknown level {level!r} (known: {', '.join(COMPRESSION_LEVELS)})"
        )
    return str(level), COMPRESSION_LEVELS[level]


def _mode(level: Any) -> tuple[str, dict[str, Any]]:
    if level not in ("sync", "async"):
        raise rx.ExperimentError(f"matrix.axes.mode: must be sync or async, got {level!r}")
    return str(level), {"system.aggregation_mode": level}


def _controller(level: Any) -> tuple[str, dict[str, Any]]:
    on = rx.parse_switch(level, "matrix.axes.controller")
    return f"ctrl-{'on' if on else 'off'}", {"experiment.controller": on}


def _bandwidth(direction: str) -> Callable[[Any], tuple[str, dict[str, Any]]]:
    def level(value: Any) -> tuple[str, dict[str, Any]]:
        label = "inf" if value is None else f"{value:g}"
        return f"{direction}-{label}", {f"emulation.{direction}link_mbps": value}

    return level


def _seed(level: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(level, int) or isinstance(level, bool):
        raise rx.ExperimentError(f"matrix.axes.seed: seeds must be integers, got {level!r}")
    return f"seed-{level}", {"training.seed": level}


def _clock(level: Any) -> tuple[str, dict[str, Any]]:
    if level not in ("real", "virtual"):
        raise rx.ExperimentError(f"matrix.axes.clock: must be real or virtual, got {level!r}")
    return str(level), {"system.clock": level}


def _transport(level: Any) -> tuple[str, dict[str, Any]]:
    if level not in ("grpc", "tcp"):
        raise rx.ExperimentError(f"matrix.axes.transport: must be grpc or tcp, got {level!r}")
    return str(level), {"system.transport": level}


def _architecture(level: Any) -> tuple[str, dict[str, Any]]:
    labels = {"parameter_server": "ps", "ddp": "ddp", "baseline": "baseline"}
    if level not in labels:
        raise rx.ExperimentError(f"matrix.axes.architecture: must be one of {', '.join(labels)}, got {level!r}")
    return labels[level], {"system.architecture": level}


NAMED_AXES: dict[str, Callable[[Any], tuple[str, dict[str, Any]]]] = {
    "mode": _mode,
    "compression": _compression,
    "controller": _controller,
    "uplink_mbps": _bandwidth("up"),
    "downlink_mbps": _bandwidth("down"),
    "seed": _seed,
    "clock": _clock,
    "architecture": _architecture,
    "transport": _transport,
}
"""Axes whose levels are plain values: each maps a level to (its label in run names, dotted overrides)."""


def axis_levels(name: str, levels: Any) -> list[tuple[str, dict[str, Any]]]:
    """``[(label, dotted overrides)]`` of one axis: a list of values for a named axis, or ``{label: overrides}``."""
    if isinstance(levels, Mapping):
        out = []
        for label, overrides in levels.items():
            if overrides is not None and not isinstance(overrides, Mapping):
                raise rx.ExperimentError(f"matrix.axes.{name}.{label}: must be a mapping of dotted fields to values")
            out.append((str(label), dict(overrides or {})))
        return out
    if name not in NAMED_AXES:
        raise rx.ExperimentError(
            f"matrix.axes.{name}: unknown axis; give its levels as a mapping "
            f"(level name -> dotted overrides) or use one of {', '.join(NAMED_AXES)}"
        )
    if not isinstance(levels, list) or not levels:
        raise rx.ExperimentError(f"matrix.axes.{name}: must be a non-empty list of levels")
    return [NAMED_AXES[name](level) for level in levels]


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, field = dotted.partition(".")
    if not field:
        raise rx.ExperimentError(f"override {dotted!r}: must be section.field (e.g. system.compression_ratio)")
    data.setdefault(section, {})
    if not isinstance(data[section], dict):
        raise rx.ExperimentError(f"override {dotted!r}: {section} is not a section")
    data[section][field] = copy.deepcopy(value)


def expand(
    matrix_file: Mapping[str, Any], default_name: str
) -> tuple[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """``(matrix name, [(experiment section, run config dict)])``: one entry per combination of levels."""
    data = dict(matrix_file)
    matrix = dict(data.pop("matrix", None) or {})
    unknown = sorted(set(matrix) - {"name", "axes"})
    if unknown:
        raise rx.ExperimentError(f"matrix.{unknown[0]}: unknown key (known: axes, name)")
    name = str(matrix.get("name") or default_name)
    if name == PLOTS_FOLDER:
        raise rx.ExperimentError(f"matrix.name: {PLOTS_FOLDER!r} is where scripts/plot_results.py draws; pick another")
    axes = matrix.get("axes") or {}
    if not isinstance(axes, Mapping) or not axes:
        raise rx.ExperimentError("matrix.axes: required, a mapping of axis name -> levels")
    expanded = [axis_levels(axis, levels) for axis, levels in axes.items()]
    base_experiment, base_run = rx.split_experiment(data, name)
    runs = []
    for combination in itertools.product(*expanded):
        experiment, run_data = copy.deepcopy(base_experiment), copy.deepcopy(base_run)
        for _, overrides in combination:
            for dotted, value in overrides.items():
                if dotted.startswith("experiment."):
                    experiment[dotted.split(".", 1)[1]] = value
                else:
                    set_dotted(run_data, dotted, value)
        experiment["name"] = "__".join(label for label, _ in combination)
        experiment["controller"] = rx.parse_switch(experiment.get("controller", False), "experiment.controller")
        runs.append((experiment, run_data))
    names = [e["name"] for e, _ in runs]
    if len(set(names)) != len(names):
        raise rx.ExperimentError("matrix.axes: two levels of one axis have the same label")
    return name, runs


def check_datasets(configs: list[Config]) -> None:
    """Make sure every dataset the runs use loads (each distinct dataset and folder once, before the first run).

    Raises:
        DatasetUnavailableError: a dataset's files are missing and cannot be downloaded.
    """
    from src.training.data import check_dataset  # loads torch: only once the matrix file is good

    checked = set()
    for config in configs:
        key = (config.training.dataset, config.training.data_dir, config.training.num_samples)
        if key not in checked:
            checked.add(key)
            check_dataset(config.training)


def describe(summary: Mapping[str, Any]) -> str:
    parts = [
        f"accuracy {summary['final_accuracy']:.4f}",
        f"train {summary.get('train_time_s', summary['total_time_s']):.1f} s",
    ]
    if summary.get("target_accuracy") is not None:
        reached = summary.get("time_to_target_s")
        parts.append(f"to {summary['target_accuracy']:g}: {'not reached' if reached is None else f'{reached:.1f} s'}")
    parts.append(f"sent {summary.get('bytes_sent', 0) / 1e6:.1f} MB")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="matrix file (YAML or JSON)")
    parser.add_argument(
        "--results-dir", default="results", help="runs go to <results-dir>/<matrix name>/ (default results)"
    )
    parser.add_argument("--list", action="store_true", help="print the runs the matrix expands into and exit")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch's intra-op threads for every run (default: torch's own). A virtual run's figures are the same "
        "on any machine at the same N; the findings' records are made with --threads 1",
    )
    parser.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="delete each run's final checkpoint once the run is done (a findings matrix needs only the summaries "
        "and events; the checkpoint of a run is its whole model, megabytes each)",
    )
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        type=parse_assignment,
        metavar="FIELD=VALUE",
        help="set a field of the matrix file before it is expanded, repeatable: --set training.data_dir=/data "
        "--set matrix.axes.seed=[0] (value read as YAML; an axis level's overrides win over the base's)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        print(f"config error: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    try:
        data = apply_assignments(read_config_file(args.config), dict(args.assignments or []))
        name, runs = expand(data, Path(args.config).stem)
        root = Path(args.results_dir) / name
        # every run checked before the first starts
        configs = [rx.build_config(experiment, run_data, root / experiment["name"]) for experiment, run_data in runs]
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    except rx.ExperimentError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for experiment, _ in runs:
            print(root / experiment["name"])
        return 0

    from src.training.data import DatasetUnavailableError  # loads torch: only once the matrix file is good

    try:
        check_datasets(configs)
    except DatasetUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no run was started", file=sys.stderr)
        return 130

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    failed = 0
    total = len(runs)
    print(f"matrix {name}: {total} runs into {root}", flush=True)
    try:
        for index, (experiment, run_data) in enumerate(runs, 1):
            run_dir = root / experiment["name"]
            prefix = f"[{index}/{total}] {experiment['name']}"
            if rx.is_finished(run_dir):
                print(f"{prefix}: skipped (finished earlier)", flush=True)
                continue
            redo = " (redone: interrupted earlier)" if run_dir.exists() else ""
            started = time.perf_counter()
            try:
                summary = rx.run_experiment(experiment, run_data, root, quiet=True)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed run must not stop the grid
                failed += 1
                print(
                    f"{prefix}: FAILED after {time.perf_counter() - started:.1f} s{redo}: {type(exc).__name__}: {exc}",
                    flush=True,
                )
                continue
            if args.no_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"{prefix}: done in {time.perf_counter() - started:.1f} s{redo}: {describe(summary)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the current run is redone next time", file=sys.stderr)
        return 130
    print(
        f"matrix {name}: {total - failed}/{total} runs finished; "
        f"plots: python scripts/plot_results.py --results {root}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
