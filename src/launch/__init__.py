"""Starting runs: the PS and DDP launchers, the runners' shared flags, experiments and matrices, provenance."""
