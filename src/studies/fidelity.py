"""How faithful virtual time is: the same experiment on the real clock and on the virtual one, compared.

``scripts/fidelity.py`` runs it; ``docs/virtual_time.md`` holds the measured table. For one
parameter-server config:

1. calibrate the cost model on this machine (:func:`src.virtual.calibration.calibrate`, with as many
   processes computing at once as the real run has workers, one thread each, as the local launcher
   gives them);
2. run the experiment for real (:func:`src.launch.ps.run_local`: processes, emulated stragglers
   and links as real waits) for each seed;
3. run it in virtual time (:func:`src.virtual.run.run_virtual`) with the calibrated figures;
4. compare throughput, time to target and final accuracy seed by seed: a seed gives both runs the
   same data order, so in sync mode the same updates (the accuracy curves agree point for point) and
   the ratio virtual / real of each seed isolates the timing; the median over seeds is reported,
   with the real runs' own spread (the same command run again on this machine).

:func:`compare_with_real` does steps 1, 3 and 4 for a real run made elsewhere, e.g. across network namespaces with
each server shard's link shaped by ``tc`` (``tests/test_virtual_shards_fidelity.py``): given that run's config (as
its final checkpoint holds it) and summary, and the figures of its setting that its config does not hold (the shaped
links' rate as ``server_mbps``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from src.config import Config, validate_config
from src.virtual.calibration import calibrate


def with_clock(config: Config, clock: str, figures: dict[str, float], run_dir: Path) -> Config:
    """``config`` on ``clock`` with the cost model's ``figures``, writing under ``run_dir``."""
    data = config.to_dict()
    data["system"].update(clock=clock, log_dir=str(run_dir / "logs"), checkpoint_dir=str(run_dir / "checkpoints"))
    if config.system.auth_token is not None:
        data["system"]["auth_token"] = config.system.auth_token.get_secret_value()
    data["emulation"].update(figures)
    return validate_config(data)


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "throughput_samples_per_s": summary["throughput_samples_per_s"],
        "time_to_target_s": summary["time_to_target_s"],
        "train_time_s": summary["train_time_s"],
        "final_accuracy": summary["final_accuracy"],
        "versions": summary["versions"],
    }


def _paired_ratio(virtual: list[dict[str, Any]], real: list[dict[str, Any]], name: str) -> float | None:
    """Median over seeds of virtual / real for figure ``name`` (seeds where both have it)."""
    ratios = [v[name] / r[name] for v, r in zip(virtual, real) if v[name] is not None and r[name]]
    return statistics.median(ratios) if ratios else None


def _spread(real: list[dict[str, Any]], name: str) -> list[float] | None:
    """The real runs' figure ``name`` relative to their median: how far a re-run here moves it."""
    values = [r[name] for r in real if r[name] is not None]
    if not values:
        return None
    middle = statistics.median(values)
    return [round(min(values) / middle, 3), round(max(values) / middle, 3)]


def _compared(measured: dict[str, Any], real: list[dict[str, Any]], virtual: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison of the runs, seed by seed: each ratio virtual / real, the real runs' spread, the accuracies."""
    result: dict[str, Any] = {"calibration": measured, "real": real, "virtual": virtual}
    for name in ("throughput_samples_per_s", "time_to_target_s", "train_time_s"):
        result[f"{name}_ratio"] = _paired_ratio(virtual, real, name)
        result[f"{name}_real_spread"] = _spread(real, name)
    accuracies = [r["final_accuracy"] for r in real]
    result["real_accuracy_range"] = [min(accuracies), max(accuracies)]
    result["virtual_accuracy_median"] = statistics.median(v["final_accuracy"] for v in virtual)
    return result


def compare_with_real(
    config: Config, real: dict[str, Any], out_dir: str | Path, *, setting: dict[str, Any], steps: int = 10
) -> dict[str, Any]:
    """Calibrate here and run ``config`` in virtual time (under ``out_dir``), against ``real``: the summary of a real
    run of ``config`` made elsewhere; ``setting``: the cost-model figures of that run's setting that ``config`` does
    not hold (``server_mbps``: each server shard's link rate). The same comparison as :func:`compare`, of one run
    each, plus the virtual run's summary (``virtual_summary``: its checkpoint, its per-shard load)."""
    from src.virtual.run import run_virtual

    measured = calibrate(config, concurrent=config.system.num_workers, steps=steps)
    figures = {**measured["emulation"], **setting}
    summary = run_virtual(with_clock(config, "virtual", figures, Path(out_dir)), tensorboard=False)
    return {**_compared(measured, [_figures(real)], [_figures(summary)]), "virtual_summary": summary}


def compare(
    config: Config, out_dir: str | Path, *, seeds: tuple[int, ...] = (0, 1, 2), steps: int = 20
) -> dict[str, Any]:
    """Calibrate, run real and virtual per seed (see the module docstring); returns the comparison.

    ``real`` and ``virtual`` list one run's figures per seed; each ratio is the median over seeds of
    virtual / real; each ``*_real_spread`` is [min, max] of the real runs over their median.
    """
    from src.launch.ps import run_local
    from src.virtual.run import run_virtual

    out_dir = Path(out_dir)
    measured = calibrate(config, concurrent=config.system.num_workers, steps=steps)
    figures = measured["emulation"]
    real, virtual = [], []
    for seed in seeds:
        seeded = config.model_copy(update={"training": config.training.model_copy(update={"seed": seed})})
        real.append(_figures(run_local(with_clock(seeded, "real", {}, out_dir / f"real_seed{seed}"))))
        virtual.append(
            _figures(
                run_virtual(with_clock(seeded, "virtual", figures, out_dir / f"virtual_seed{seed}"), tensorboard=False)
            )
        )
    return _compared(measured, real, virtual)
