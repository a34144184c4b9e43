"""Telemetry beside ``src/metrics.py``: timelines (tracing), experiment trackers, exposed communication, logging."""
