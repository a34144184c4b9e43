"""Shared helpers for the tests on Linux network namespaces: shaping a link with ``tc``, removing a namespace.

The tests that run real processes across namespaces (tests/test_ps_multihost.py, tests/test_netem.py,
tests/test_spans.py) create their own topologies; what they do alike is here.
"""

from __future__ import annotations

import os
import subprocess


def shape_egress(namespace: str, device: str, mbps: float) -> None:
    """Real shaping: a token bucket of ``mbps`` Mbit/s on ``device``'s egress in ``namespace`` (``tc ... tbf``)."""
    command = (
        f"ip netns exec {namespace} tc qdisc replace dev {device} root tbf rate {mbps:g}mbit burst 32kb latency 400ms"
    )
    subprocess.run(command.split(), check=True, capture_output=True, timeout=30)


def remove_namespace(name: str) -> None:
    """Kill every process left in namespace ``name``, then delete it (with the veth ends inside); no error if gone."""
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
