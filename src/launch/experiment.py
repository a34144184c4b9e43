r"""Run one experiment into ``results/<name>/``: its config, events, summary and TensorBoard logs.

    python scripts/run_experiment.py --config configs/smoke_fmnist.yaml
    python scripts/run_experiment.py --config configs/smoke_fmnist.yaml --set training.data_dir=/data/torchvision
    python scripts/run_experiment.py --config configs/experiments/smoke.yaml
    python scripts/run_experiment.py --config configs/experiments/smoke.yaml --seed 1 --name smoke_seed1
    python scripts/run_experiment.py --config configs/experiments/smoke.yaml \
        --set training.weight_decay=1e-4 --print-config

Experiment files: ``configs/smoke_*.yaml`` (smoke runs), ``configs/baselines/`` (dense and fixed-compression
baselines), ``configs/adaptive/`` (the adaptive controller), ``configs/experiments/`` (the findings' experiments
and matrices). An experiment file is a run config (``training``, ``system``, ``emulation``: see
configs/example_config.yaml and src/emulation/netem.py) plus an ``experiment`` section::

    experiment:
      name: smoke            # the run's folder under --results-dir (default: the file's name)
      controller: false      # true: the adaptive top-k controller (system.adaptive_compression)

The architecture (``system.architecture``: parameter_server, ddp or baseline), mode, compression,
emulation, seed and clock (``system.clock``: real processes, or ``virtual``: one process on a simulated
clock, src/virtual/run.py) all come from the config. What lands in ``<results-dir>/<name>/``:

| file | what |
|---|---|
| ``config.yaml`` | the full resolved config (with the experiment section) |
| ``experiment.json`` | status (running, finished, failed), wall time, load before/after, clock, commit, threads |
| ``summary.json`` | the run summary (written last: its presence with status finished means done) |
| ``logs/`` | ``server/events.jsonl`` (or the trainer's), ``worker_<k>/``, TensorBoard event files |
| ``checkpoints/`` | the final checkpoint |
| ``output.log`` | what the processes printed (matrix runs; a single run prints to the terminal) |

The dataset's files are looked for (and downloaded, when online) before the run's folder is made: where they
are missing, the run stops at once with one ``error:`` line saying where to put them (``--set
training.data_dir=DIR`` points a config at another folder).

Exit status: 0 done, 1 the run failed (one ``error:`` line), 2 a bad experiment file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from src.config import Config, ConfigError, SetupError, apply_assignments, read_config_file, validate_config
from src.launch.cli import add_config_flags, add_observability_flags, format_config
from src.reports.results import PLOTS_FOLDER
from src.telemetry.logs import setup_logging

CONTROLLER_FIELD = "adaptive_compression"
"""The ``system`` field that turns the adaptive controller on (src/adaptive/controller.py; the PS and DDP feed it)."""
EXPERIMENT_KEYS = {"name", "controller"}
DEFAULT_CHECKPOINT_INTERVAL = 1_000_000  # server versions: an experiment keeps only its final checkpoint


class ExperimentError(ValueError):
    """An experiment that cannot run as written; the message names the field."""


def split_experiment(data: Mapping[str, Any], default_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(experiment section with defaults, run config dict)`` of an experiment file's contents."""
    data = dict(data)
    experiment = dict(data.pop("experiment", None) or {})
    unknown = sorted(set(experiment) - EXPERIMENT_KEYS)
    if unknown:
        raise ExperimentError(f"experiment.{unknown[0]}: unknown key (known: {', '.join(sorted(EXPERIMENT_KEYS))})")
    experiment.setdefault("name", default_name)
    experiment["controller"] = parse_switch(experiment.get("controller", False), "experiment.controller")
    if not str(experiment["name"]).strip() or "/" in str(experiment["name"]):
        raise ExperimentError(f"experiment.name: must be a non-empty folder name, got {experiment['name']!r}")
    if str(experiment["name"]) == PLOTS_FOLDER:
        raise ExperimentError(f"experiment.name: {PLOTS_FOLDER!r} is where scripts/plot_results.py draws; pick another")
    return experiment, data


def parse_switch(value: Any, field: str) -> bool:
    """``true/false/on/off`` (YAML reads bare on/off as booleans already) -> bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
        return value.lower() in ("on", "true")
    raise ExperimentError(f"{field}: must be on/off (true/false), got {value!r}")


def build_config(experiment: Mapping[str, Any], run_data: Mapping[str, Any], run_dir: Path) -> Config:
    """The run's validated config, its outputs under ``run_dir``.

    Raises:
        ExperimentError: the controller is asked for without evaluations to decide at (or, in DDP,
            without top-k compression).
        ConfigError: a bad config field.
    """
    data = json.loads(json.dumps(run_data))  # a deep copy
    system = data.setdefault("system", {})
    training = data.setdefault("training", {})
    if experiment["controller"]:
        if not (training.get("eval_interval") or training.get("eval_every_samples")):
            raise ExperimentError(
                "experiment.controller: on decides at evaluations: set training.eval_interval "
                "(server versions, or DDP steps, between evaluations) or training.eval_every_samples"
            )
        system[CONTROLLER_FIELD] = True
    system["log_dir"] = str(run_dir / "logs")
    system["checkpoint_dir"] = str(run_dir / "checkpoints")
    training.setdefault("checkpoint_interval", DEFAULT_CHECKPOINT_INTERVAL)
    config = validate_config(data)
    if config.system.architecture == "ddp" and config.system.adaptive_compression:
        from src.ddp.control import config_problem  # loads torch: only for DDP runs with the controller

        problem = config_problem(config)
        if problem is not None:
            raise ExperimentError(problem)
    emulated = config.emulation.model_dump() != type(config.emulation)().model_dump()
    if emulated and config.system.architecture != "parameter_server" and config.system.clock != "virtual":
        raise ExperimentError(
            f"emulation: stragglers and links are emulated in the parameter server only, "
            f"not in system.architecture {config.system.architecture} (or use system.clock: virtual)"
        )
    return config


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_config(config: Config, summary_json: Path) -> dict[str, Any]:
    """Train ``config`` with its architecture's local launcher (or in virtual time); returns the run summary."""
    architecture = config.system.architecture
    if config.system.clock == "virtual" and architecture == "ddp":
        from src.virtual.ddp import run_virtual_ddp

        return run_virtual_ddp(config, summary_json=summary_json)
    if config.system.clock == "virtual":
        from src.virtual.run import run_virtual

        return run_virtual(config, summary_json=summary_json)
    if architecture == "parameter_server":
        from src.launch.ps import run_local

        return run_local(config, summary_json=summary_json)
    if architecture == "ddp":
        from src.launch.ddp import run_local as run_ddp

        return run_ddp(config, summary_json=summary_json)
    from src.trainer import BaselineTrainer

    return BaselineTrainer(config, summary_json=summary_json).run()


def is_finished(run_dir: Path) -> bool:
    """A run is finished when its summary is written and its status says so."""
    status = run_dir / "experiment.json"
    if not (run_dir / "summary.json").is_file() or not status.is_file():
        return False
    try:
        return json.loads(status.read_text()).get("status") == "finished"
    except json.JSONDecodeError:
        return False


@contextlib.contextmanager
def output_to(path: Path):
    """Send this process's stdout and stderr, and so its children's, to ``path`` (file descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_experiment(
    experiment: Mapping[str, Any], run_data: Mapping[str, Any], results_dir: Path, *, quiet: bool = False
) -> dict[str, Any]:
    """Run one experiment into ``results_dir/<name>/`` (an unfinished earlier attempt there is removed first).

    Returns the run summary. Raises what the launcher raises (a failed run), after writing status failed.
    """
    run_dir = Path(results_dir) / str(experiment["name"])
    config = build_config(experiment, run_data, run_dir)  # checked before anything is removed
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted attempt: redo it from scratch
    run_dir.mkdir(parents=True)
    full = {"experiment": dict(experiment), **config.to_dict()}
    import yaml

    (run_dir / "config.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    import torch

    from src.launch.provenance import code_version, kernels

    status = {
        "name": experiment["name"],
        "status": "running",
        "started": time.time(),
        "load_average_start": load_average(),
        "clock": config.system.clock,
        # this process's intra-op threads: a virtual run's last digits depend on them (a float sum's order)
        "torch_threads": torch.get_num_threads(),
        **kernels(),  # and the CPU kernels: another CPU's move a loss in its sixth digit
        **code_version(),
    }
    status_path = run_dir / "experiment.json"
    status_path.write_text(json.dumps(status, indent=2) + "\n")
    started = time.perf_counter()
    summary_path = run_dir / "summary.json.partial"
    try:
        if quiet:
            with output_to(run_dir / "output.log"):
                summary = run_config(config, summary_path)
        else:
            summary = run_config(config, summary_path)
    except BaseException as exc:
        status.update(status="failed", error=f"{type(exc).__name__}: {exc}", wall_time_s=time.perf_counter() - started)
        status_path.write_text(json.dumps(status, indent=2) + "\n")
        raise
    summary_path.replace(run_dir / "summary.json")
    status.update(status="finished", wall_time_s=time.perf_counter() - started, load_average_end=load_average())
    status_path.write_text(json.dumps(status, indent=2) + "\n")
    return summary


def load_experiment_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = Path(path)
    return split_experiment(read_config_file(path), path.stem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment file (YAML or JSON)")
    parser.add_argument("--results-dir", default="results", help="where the run's folder goes (default results)")
    parser.add_argument("--name", help="the run's folder name (default: experiment.name, else the file's name)")
    parser.add_argument("--seed", type=int, help="override training.seed")
    add_config_flags(parser)
    add_observability_flags(parser)
    args = parser.parse_args(argv)
    try:
        experiment, run_data = load_experiment_file(args.config)
        if args.name:
            experiment["name"] = args.name
        flags = {"training.seed": args.seed, "system.trace": args.trace, "system.log_level": args.log_level}
        run_data = apply_assignments(run_data, {k: v for k, v in flags.items() if v is not None})
        if args.tracker:
            listed = (run_data.get("metrics") or {}).get("trackers", ["tensorboard"])
            run_data = apply_assignments(run_data, {"metrics.trackers": list(dict.fromkeys([*listed, *args.tracker]))})
        run_data = apply_assignments(run_data, dict(args.assignments or []))
        config = build_config(experiment, run_data, Path(args.results_dir) / str(experiment["name"]))  # check first
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    except ExperimentError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    if args.print_config:
        print(format_config(config), end="")
        return 0
    setup_logging(config.system.log_level)
    from src.common.supervisor import LaunchError
    from src.launch.cli import exit_status
    from src.metrics import format_summary
    from src.training.data import check_dataset

    def run() -> None:
        check_dataset(config.training)  # a missing dataset is one line now, not a failed run folder later
        summary = run_experiment(experiment, run_data, Path(args.results_dir))
        print(format_summary(summary))
        print(f"Results: {Path(args.results_dir) / str(experiment['name'])}")

    return exit_status(
        run,
        describe={LaunchError: str, SetupError: str},
        interrupted="interrupted: stopped the run (its folder is redone next time)",
    )


if __name__ == "__main__":
    sys.exit(main())
