"""Benchmark our sync parameter server against a torch.distributed.rpc one; prints one JSON object last.

    python scripts/bench_rpc_peer.py --output docs/ps_rpc_peer.json        # ~6 minutes on 2 cores
    python scripts/bench_rpc_peer.py --models simple_cnn --repeats 1 --arms ours_tcp   # a quick look
    python scripts/bench_rpc_peer.py --profile --models wide_mlp --output docs/ps_rpc_peer_profile.json   # ~30 s

The peer is the parameter server PyTorch's own tutorial builds ("Implementing Batch RPC Processing Using
Asynchronous Executions"): a server process with the model and an SGD optimizer, each trainer calling
``rpc_sync(update_and_fetch, gradients)`` once a step, the last trainer of a step triggering the mean, the step and
one reply future for all (``src/benchmarks/ps/rpc_peer.py``), TensorPipe restricted to TCP. Each model trains the
same 2-worker sync job (mnist_5k, the same batches in the same order, the same fused SGD) in every arm: our PS over
gRPC and TCP, unstreamed and streamed, TCP streamed with pipelined replies, TCP on 2 server shards, and the peer,
in turns, the order
flipped every repeat. Per arm: the median samples/s, ``ratio_to_peer``, the final loss and accuracy, and
``same_updates`` (they equal the peer's to the last digit: the arms computed the same updates). Progress goes to
stderr, the JSON to stdout; ``--output`` also writes it to a file. Definitions: ``src/benchmarks/ps/peer.py``.

``--profile`` instead runs each model once traced over TCP (``--trace``) and once as the peer, and prints where a
step's milliseconds go on each side: the median of each span of ours (the worker's ``forward_backward``,
``compress``, ``send``, ``await_reply``, ``receive``, ``settle``; the server's ``receive``, ``serve_push``,
``barrier_wait``, ``average``, ``optimizer_step``, ``send``) beside the peer's phases (the trainer's
``forward_backward``, ``update_and_fetch``, ``copy``; the server's ``add`` and ``close``).
"""

from __future__ import annotations

import argparse
import sys

from src.benchmarks.common import emit
from src.benchmarks.ps.peer import ARMS, bench_against_rpc_peer, profile_step

DEFAULT_EPOCHS = {"simple_cnn": 2, "wide_mlp": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(DEFAULT_EPOCHS), default=list(DEFAULT_EPOCHS))
    parser.add_argument(
        "--epochs", type=int, help="epochs of every run (default: 2 for simple_cnn, 1 for wide_mlp, 23 MB)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, in turns (medians)")
    parser.add_argument(
        "--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="which arms (the peer always runs)"
    )
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument(
        "--profile", action="store_true", help="where a step's milliseconds go, ours (TCP) beside the peer's, one run"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch_size < 1 or (args.epochs is not None and args.epochs < 1):
        parser.error("--repeats, --batch-size and --epochs must be at least 1")
    epochs = {m: args.epochs or DEFAULT_EPOCHS[m] for m in args.models}
    if args.profile:
        return emit({"profiles": [profile_step(m, epochs[m], args.batch_size) for m in args.models]}, args.output)
    result = bench_against_rpc_peer(args.models, epochs, args.batch_size, args.repeats, args.arms)
    return emit(result, args.output)


if __name__ == "__main__":
    sys.exit(main())
