"""The benchmarks behind ``scripts/bench_*.py``: each module measures one part of the system against its
reference and returns the figures as a dict (the scripts parse their flags and print it).

``suite`` runs the others, one script after another, and tables each figure beside its reference;
``common`` holds what several of them share.
"""
