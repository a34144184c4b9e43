"""The performance report and the experiments' results: inputs, sections, plots, rendering."""
