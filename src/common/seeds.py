"""Every seed of a run derived one way from ``training.seed``: data order, stochastic rounding, emulated delays.

A run has one seed; each random stream in it (the data order of an epoch, a worker's stochastic
rounding, a worker's emulated delays, a DDP rank's rounding of one bucket at one step, a simulated
process's request ids) gets its own seed from :func:`derive_seed` of the run's seed and the stream's
coordinates, so streams are distinct, a re-run repeats every one of them, and no module invents a formula.

The formula is part of every committed result: the data order of ``derive_seed(seed, epoch)`` and the
rounding of ``derive_seed(seed, worker)`` fix the numbers in ``docs/findings/*.json``. Changing it changes
every run (``tests/test_seeds.py`` holds it). For the same reason the data order of epoch ``e`` and
worker ``e``'s rounding keep sharing a seed: they drive different generators (a permutation, rounding
noise), and separating them would re-measure every record.
"""

from __future__ import annotations

SEED_MULTIPLIER = 1_000_003
"""A prime: runs whose seeds differ by one get streams far apart."""
SEED_MODULUS = 2**62
"""Below every generator's limit (``torch.Generator.manual_seed``, ``random.Random``, numpy)."""

DELAY_STREAM = 7_919
"""The last coordinate of a worker's emulated-delay stream, so it differs from the worker's rounding stream."""


def derive_seed(seed: int, *coordinates: int) -> int:
    """The seed of the stream at ``coordinates`` (``epoch``; ``worker, DELAY_STREAM``; ...) of run seed ``seed``."""
    value = seed
    for coordinate in coordinates:
        value = value * SEED_MULTIPLIER + coordinate
    return value % SEED_MODULUS
