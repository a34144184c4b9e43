"""Ring-allreduce DDP: a rank's set-up, job, checkpoints, evaluation, watchdog, comm hooks, the ring and
the exchanges.
"""
