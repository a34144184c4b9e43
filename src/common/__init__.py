"""What every part of the framework shares: seeds, clocks, numeric bounds, checkpoints, process supervision, faults."""
