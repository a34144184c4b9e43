"""Python logging for every process of a run: one format, one level, on stderr.

Modules log through ``logging.getLogger(__name__)`` (names ``src.trainer``, ``src.launch.ps``...);
a runner calls :func:`setup_logging` once (``src.launch.cli.config_from_args`` does, at ``--log-level`` /
``system.log_level``), and so does every child process the launchers spawn, from the config it was
given, because a spawned process starts with logging unconfigured. Third-party libraries (torch,
gRPC, MLflow, wandb) stay at WARNING whatever our level is, so ``--log-level debug`` shows this
project's debug lines only.

What goes where: progress and notices (``epoch 1/2: test accuracy ...``, ``launcher: worker-1 killed
by SIGKILL; restarting it``) are log records on stderr; the runner's final summary (``Final
Accuracy: ...``) and machine-readable output stay ``print``-ed on stdout, so ``stdout`` of a
runner is only its result.

Format: ``HH:MM:SS LEVEL logger: message``, e.g. ``12:00:01 INFO src.trainer: epoch 1/2: ...``.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
PROJECT_LOGGERS = ("src", "torch_asgc", "__main__")
"""The loggers whose level :func:`setup_logging` sets; every other logger stays at WARNING."""
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

_handler: logging.Handler | None = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test's capture, a redirected run)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


def setup_logging(level: str = "info") -> None:
    """Send log records to stderr in :data:`LOG_FORMAT`: this project's at ``level``, others' at WARNING.

    Idempotent: a second call only changes the level (a process that is both a runner and a
    launcher's child does not print each line twice).

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.

    Raises:
        ValueError: an unknown level.
    """
    global _handler
    if level not in LEVELS:
        raise ValueError(f"system.log_level: must be one of {', '.join(LEVELS)}, got {level!r}")
    root = logging.getLogger()
    if _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        root.addHandler(_handler)
    root.setLevel(logging.WARNING)
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(LEVELS[level])
