"""What several benchmarks share: progress lines on stderr (stdout carries only the JSON they print)."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """One progress line on stderr, flushed at once (a long benchmark shows where it is)."""
    print(message, file=sys.stderr, flush=True)
