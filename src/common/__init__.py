"""What every part of the framework shares: seeds, clocks, numeric bounds, checkpoints, starting and supervising
processes, faults."""
