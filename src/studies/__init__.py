"""Studies of async training: simulations, stability analysis, configuration studies, virtual-time fidelity."""
