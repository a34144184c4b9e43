"""The server core (:class:`~src.ps.server.core.ServerCore`: the one implementation every server driver runs) and its
collaborators: the workers' lifecycle, de-dup of pushes, updates, the work source, control, checkpoints, evaluations,
the run's totals."""
