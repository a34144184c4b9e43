"""Benchmark the parameter server at the wire's limit, per transport; prints one JSON object last.

    python scripts/bench_ps.py --output bench_ps.json      # all of it (~5 min on 2 cores)
    python scripts/bench_ps.py --skip-training --skip-ceiling --skip-shards --skip-netns  # round trips, per shard too
    python scripts/bench_ps.py --skip-round-trips --skip-ceiling --skip-training  # only the shards (a) and (b)
    python scripts/bench_ps.py --sizes-mb 1 4 --repeats 20 --transports tcp

Progress goes to stderr, the JSON to stdout; ``--output`` also writes it to a file.

``round_trips``: one entry per transport (``grpc``, ``tcp``) and model (~1, 4, 16 MB of 8 float32
tensors, and a resnet18 of ~43 MB): one step of the protocol (a push of identity payloads, every
gradient uncompressed, whose reply carries the new parameters and the next work) against

* ``raw_tcp_echo_ms``: the same bytes over a plain TCP connection in Python (the push's size up,
  the reply's size down, ``recv_into`` preallocated buffers, no server work), both ends reading at
  most ``RECEIVE_CHUNK_BYTES`` (32 KB) a read, as the TCP transport does: what the wire costs;
* ``raw_tcp_echo_whole_reads_ms``: the same echo with each read asking for all that is left of the
  message (the anchor as first measured): on loopback here such multi-MB reads make the kernel
  retransmit and take up to 1.8x as long from 4 MB up, so it is shown, not used as the limit;
* ``grpc_echo_ms`` (gRPC entries): the same through a raw gRPC bytes echo (no protobuf, no server work);
* ``optimizer_step_ms``: torch's own SGD-momentum step (fused, as the server's) on the same floats,
  in the server's process: the work the server must do;
* ``stepping_echo_ms``: the least a server that steps costs here: the raw echo's server taking the
  push's bytes as the gradients (views of its buffer), running the same step with them and sending
  the parameters back from their own memory: no check, no protocol, no bookkeeping. Its step is on
  tensors the transfers have just gone past, as a real server's is, so it is slower than
  ``optimizer_step_ms`` (timed on tensors in the cache); ``stepping_echo_limit_ratio`` = (echo +
  step) / ``stepping_echo_ms`` is the most ``limit_ratio`` any server could reach in the run, and
  ``stepping_echo_ratio`` = ``stepping_echo_ms`` / ``ps_round_trip_ms`` what our protocol, checks and
  bookkeeping cost on top of it.

``limit_ratio`` = (``raw_tcp_echo_ms`` + ``optimizer_step_ms``) / ``ps_round_trip_ms``: 1.0 means the
round trip costs only moving the bytes and stepping. Targets: TCP >= 0.8 from 4 MB, >= 0.6 at 1 MB;
gRPC ``grpc_limit_ratio`` = (``grpc_echo_ms`` + ``optimizer_step_ms``) / ``ps_round_trip_ms`` >= 0.8.
``server_ms`` breaks the server's own work per push down (measured inside the server): ``decode``
(payload checks and views, outside the lock), ``decode_while_receiving`` (the part of it done as
the push arrived: TCP decodes each gradient once its bytes are in), ``step`` (the optimizer),
``reply`` (building the reply's pieces, views of the parameters), ``locked`` (everything done under
the core's lock per push: what serializes pushes). The server runs in its own process, async mode
(no correction: the plain optimizer), one worker, so each push is decoded, checked and applied
before the reply is built.
Median of ``--repeats`` after one warm-up; the PS step and the echoes alternate, so a slow spell of a
shared machine slows all of them rather than one.

``shard_round_trips`` (over TCP, with the round trips; ``--skip-shard-round-trips``: not): per size, one follower
shard's link per sync step of 2 shards, one worker: ``shard_round_trip_ms`` = the follower's hold (its slices up,
an acknowledgement down) + its pull (the certificate up, the follower's step, its slices down) as the worker times
each call, made one at a time (shard 0's hold, commit and pull outside it), beside ``raw_tcp_echo_ms`` and
``stepping_echo_ms`` of the same bytes on the follower's slices, in its process; ``stepping_echo_ratio`` =
``stepping_echo_ms`` / ``shard_round_trip_ms``, ``target`` 0.85 from 4 MB. The model has 8 tensors of twice the
size, 4 a shard, so the follower's link carries the row's size (``shard_mb``); from 20 MB it is resnet18 (the
follower about half). ``server_ms``: the follower's own parts (``decode`` of the hold, of which
``decode_while_receiving``, ``hold``, ``step``, ``reply``, the whole ``pull`` under its lock). Definitions:
``src/benchmarks/ps/round_trips.py``.

``ceiling``: pushes/s and GB/s into one server from 1, 4, 8 and 16 light clients (threads of one
client process, no compute: a push, its reply, the next push) per transport, on a ~4 MB model in
async mode; ``saturated_at_clients`` is the fewest clients reaching 90% of the best rate, and
``serial_ms_per_push`` the time each push holds the core's lock (its bound: 1000 / that pushes/s).

``shards``: per transport, pushes/s and GB/s (the clients' bytes in, and in + out) into one server and into 2
server shards from 4 light clients (threads of one client process, no compute), sync, on the ~4 MB model (8
tensors, 4 per shard), each server in its own process, for ``--shards-seconds`` per run, ``--shards-repeats`` runs
of each case in turns (each case's row: its run of median pushes/s): one server taking the plain push
(the reference: what a one-server run's worker does), one shard taking the sharded step (hold, commit, pull:
the step's own cost) and 2 shards taking it, each of its three calls sent to every shard at once, as
``src/worker.py`` does. ``rows[].shards`` is each shard's own count of its messages' bytes per push and per
second, and its optimizer's ms per version; ``ratio_to_one_server`` = 2 shards' pushes/s / one server's. On 2
cores the servers and the clients share the CPUs, so this measures what the split costs or buys on loopback,
not on separate hosts (that is ``shards_netns``).

``shards_netns``: samples/s of a short sync run of ``run_parameter_server_training.py`` across network
namespaces (simple_cnn, mnist_5k, 512 samples, 1 epoch, batch 16 per worker, 2 workers in namespaces of their
own with unshaped links, ``system.shard_slice_bytes`` 65536, TCP), with 1 server shard and with 2, each
shard in a namespace whose link ``tc`` limits to ``--netns-mbps`` both ways (50 Mbit/s: at 200 the
non-link time per step, which 2 shards do not shrink, held the ratio to 1.65 on 2 cores); ``ratio`` = 2 shards'
samples/s / 1 shard's (target >= 1.8); ``link_s`` each run's bytes over its shards' links, pushes and pulls one
after the other (``link_overlapped_s``: each direction alone), ``not_halved_s`` = 2 x the 2-shard run's time - the
1-shard run's: what 2 shards did not halve (compute, round trips, the servers' work), so ratio = 2 - that / T2. With
``--netns-pipelined``, 2-shard runs streamed and streamed with pipelined replies too, and their samples/s ratio
(``pipelined_over_streamed``). With ``--netns-virtual``, each arm's last run again in virtual time, its config from
its checkpoint, calibrated here, each shard's NIC at the tc rate (``virtual``: samples/s and the steady step both
ways, virtual / real); ``--netns-trace-dir DIR`` traces every process and keeps each arm's traces in DIR
(``scripts/plot_trace.py`` draws them). Needs root and iproute2: otherwise ``skipped`` says why.

``crossover`` (only with ``--crossover``; ~25 minutes): when a sharded PS beats ring allreduce, in virtual time
(:mod:`src.benchmarks.ps.crossover`): for 1 and 10 Gbit/s links, n in {4, 8, 16, 32, 64} workers and k in {1, 2, 4,
8, 16} shards, the seconds per sync step of the PS and of DDP (``wide_mlp``, 23 MB), beside the formulas: ours
``c + 2 max(M/B, n M/(k B))`` (push, then pull), BytePS's ``c + max(M/B, n M/(k B))`` (push and pull overlapped
on full-duplex links) and ring allreduce's ``c + 2 (n-1)/n M/B``; up to 16 workers the PS with pipelined replies
too (``ps_pipelined_step_s``: the pull overlapping the push), with its communication seconds against the ring's
(``communication_over_ring``; ``target_n16_k16_1gbit``: issue 33's cell); ``crossover``: the fewest shards
beating DDP per link and n, measured, pipelined and by BytePS's formula; ``--crossover-plot`` draws them.

``training``: samples/s of a 2-worker sync PS run per transport (processes, as
``run_parameter_server_training.py`` starts them), a 2-worker async run over TCP and 2-rank DDP, on
the same data (mnist_5k, batch 64 per worker/rank, simple_cnn, CPU, 2 epochs) in the same run, each
``--training-repeats`` times in turns (medians); target PS (TCP) sync >= 0.9 of DDP. Every run evaluates
only at its end (``training.eval_at_epoch_ends: false``): DDP pauses its clock to evaluate, the PS would
evaluate on a thread beside its workers, on the cores they share.
"""

from __future__ import annotations

import argparse
import sys

from src.benchmarks import ps
from src.benchmarks.common import emit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", nargs="+", choices=("grpc", "tcp"), default=["grpc", "tcp"])
    parser.add_argument(
        "--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 45], help="model sizes (>= 40 means resnet18)"
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed round trips per size (median reported)")
    parser.add_argument(
        "--ceiling-clients", type=int, nargs="+", default=[1, 4, 8, 16], help="light clients per ceiling run"
    )
    parser.add_argument("--ceiling-seconds", type=float, default=4.0, help="seconds each ceiling run pushes")
    parser.add_argument("--skip-round-trips", action="store_true")
    parser.add_argument(
        "--skip-shard-round-trips", action="store_true", help="round trips of one server only, no per-shard row"
    )
    parser.add_argument("--skip-ceiling", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-shards", action="store_true", help="no one server against 2 shards on loopback")
    parser.add_argument("--shards-seconds", type=float, default=2.0, help="seconds each shards case steps")
    parser.add_argument("--shards-repeats", type=int, default=3, help="runs of each shards case, in turns (medians)")
    parser.add_argument("--skip-netns", action="store_true", help="no shard runs across network namespaces")
    parser.add_argument(
        "--netns-mbps", type=float, default=50.0, help="each server shard's link across namespaces, Mbit/s each way"
    )
    parser.add_argument("--netns-repeats", type=int, default=1, help="runs of each shard count (medians)")
    parser.add_argument(
        "--netns-pipelined",
        action="store_true",
        help="across namespaces, 2-shard runs streamed and streamed with pipelined replies too (TCP)",
    )
    parser.add_argument(
        "--netns-virtual",
        action="store_true",
        help="across namespaces, each arm's run again in virtual time (calibrated here): virtual / real per arm",
    )
    parser.add_argument(
        "--netns-trace-dir",
        help="across namespaces, every process traced; each arm's last run's traces kept here (ARM/real/ROLE/, "
        "ARM/virtual/ROLE/)",
    )
    parser.add_argument(
        "--crossover",
        action="store_true",
        help="also the sharded PS against ring allreduce in virtual time (k x n x links, ~20 min on 2 cores)",
    )
    parser.add_argument("--crossover-plot", help="with --crossover: draw the step times into this PNG")
    parser.add_argument("--num-epochs", type=int, default=2, help="epochs of each training run")
    parser.add_argument("--training-repeats", type=int, default=3, help="runs of each training case (medians)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    result = ps.run_benchmark(
        args.transports,
        args.sizes_mb,
        args.repeats,
        args.ceiling_clients,
        args.ceiling_seconds,
        args.num_epochs,
        args.training_repeats,
        args.batch_size,
        round_trips=not args.skip_round_trips,
        shard_round_trips=not args.skip_shard_round_trips,
        ceiling=not args.skip_ceiling,
        training=not args.skip_training,
        shards=not args.skip_shards,
        shards_seconds=args.shards_seconds,
        shards_repeats=args.shards_repeats,
        netns=not args.skip_netns,
        netns_mbps=args.netns_mbps,
        netns_repeats=args.netns_repeats,
        netns_pipelined=args.netns_pipelined,
        netns_virtual=args.netns_virtual,
        netns_trace_dir=args.netns_trace_dir,
        crossover=args.crossover,
        crossover_plot=args.crossover_plot,
    )
    return emit(result, args.output)


if __name__ == "__main__":
    sys.exit(main())
