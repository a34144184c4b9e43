"""Emulated time: stragglers and slow links on the real clock, the cost model and event loop of the virtual one."""
