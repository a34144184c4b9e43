"""What several benchmarks share: progress lines on stderr, and the one JSON document they print on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    """One progress line on stderr, flushed at once (a long benchmark shows where it is)."""
    print(message, file=sys.stderr, flush=True)


def emit(result: Any, output: str | None) -> int:
    """Print ``result`` as the run's one JSON document (also written to ``output``, if given); exit status 0."""
    text = json.dumps(result, indent=2)
    if output:
        Path(output).write_text(text + "\n")
    print(text)
    return 0
