"""The quadratic model of src/studies/async_stability.py: heavy-ball momentum's known stability limit, and the order
of the async variants' limits and speeds that docs/async.md reports.

Tolerances: the limit is found on a log grid of 1,200 points from 1e-3 to 8 (neighbours 0.75% apart), and
a run just below the limit converges too slowly to count as converged in 4,000 steps, so the found limit
is within 2% of the analytic one.
"""

from __future__ import annotations

import pytest

from src.studies.async_stability import largest_stable_h, progress_per_epoch, stability_rows, stability_table


@pytest.mark.slow
def test_sync_momentum_is_stable_up_to_two_times_one_plus_momentum():
    assert largest_stable_h(0.9, 2, "sync") == pytest.approx(2 * (1 + 0.9), rel=0.02)
    assert largest_stable_h(0.0, 2, "sync") == pytest.approx(2.0, rel=0.02)


@pytest.mark.slow
def test_plain_async_is_far_less_stable_and_implicit_momentum_buys_stability_with_speed():
    sync, plain, implicit = (largest_stable_h(0.9, 2, method) for method in ("sync", "plain", "implicit_momentum"))
    assert plain < implicit < sync
    assert plain < sync / 10
    # Along a flat direction: plain async moves twice as far per epoch as sync (N pushes, each a full
    # step), implicit momentum (0.9 - 1/2 = 0.4) a third as far; sync and lookahead alike.
    assert progress_per_epoch(0.9, 2, "plain") == pytest.approx(2.0)
    assert progress_per_epoch(0.9, 2, "implicit_momentum") == pytest.approx(1 / 3)
    assert progress_per_epoch(0.9, 2, "lookahead") == progress_per_epoch(0.9, 2, "sync") == 1.0


def test_the_table_has_one_line_per_row_under_its_header():
    rows = [
        {"workers": 2, "method": m, "largest_stable_lr_times_lam": h, "progress_per_epoch_vs_sync": p}
        for m, h, p in (("sync", 3.8, 1.0), ("plain", 0.1, 2.0))
    ]
    lines = stability_table(rows, 0.9).splitlines()
    assert lines[0] == "momentum 0.9, round-robin pushes (staleness N-1)" and lines[1] == ""
    assert lines[4:] == ["| 2 | sync | 3.8 | 1.0 |", "| 2 | plain | 0.1 | 2.0 |"]
    assert [row["method"] for row in stability_rows(0.0, [])] == []
