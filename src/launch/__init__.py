"""Starting runs: the PS and DDP launchers, the runners' shared flags, experiments and matrices, provenance.

Importing this package, which every runner does before torch is loaded, makes idle OpenMP threads sleep in the
runner and every process it starts (:mod:`src.common.threads`).
"""

from src.common.threads import idle_threads_sleep

idle_threads_sleep()
