"""The async study's configurations and its table (src/studies/async_study.py), from results written by hand:
the runs themselves are real runner processes, too long for a unit test (the command is
``scripts/async_study.py``)."""

from __future__ import annotations

from src.studies.async_study import preset, study_configs, table


def test_configurations_are_the_named_ones_then_the_presets_that_match():
    configs = study_configs(
        ["mine=--workers 3 --aggregation-mode async"], "mnist_5k", "--max-train-samples 64", "async"
    )
    assert configs[0] == ("mine", "--workers 3 --aggregation-mode async")
    presets = configs[1:]
    assert [name for name, _ in presets] == ["async N=2", "async N=2 topk 0.1", "async N=4", "async N=4 topk 0.1"]
    assert all("--dataset mnist_5k --num-epochs 2 --max-train-samples 64" in flags for _, flags in presets)
    assert len(preset("mnist")) == 8 and study_configs([], None) == []


def test_the_table_gives_mean_min_max_over_runs_and_sums_the_histograms():
    runs = [
        {"name": "a", "final_accuracy": 0.5, "mean_staleness": 1.0, "staleness_histogram": {"0": 2, "1": 1}},
        {"name": "a", "final_accuracy": 0.7, "mean_staleness": 0.0, "staleness_histogram": {"1": 3}},
        {"name": "a", "rc": 1},
        {"name": "b", "rc": 1},
    ]
    lines = table(runs).splitlines()
    assert lines[2] == "| a | 2/3 | 60.00 | 50.00 | 70.00 | 0.50 | 0: 2, 1: 4 |"
    assert lines[3] == "| b | 0/1 | failed | | | | |"
