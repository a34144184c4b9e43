"""Regenerate the parameter server's gRPC stubs from ``protos/parameter_server.proto``.

    python scripts/gen_protos.py           # write src/parameter_server_pb2.py{,i}
    python scripts/gen_protos.py --check   # exit 1 if the committed stubs do not match the .proto

The proto is compiled under the virtual path ``src/parameter_server.proto`` (``-Isrc=protos``), so
the generated modules import each other as ``from src import ...`` without patching their text.
``--check`` compares descriptors, not file text, so a different grpcio-tools version that emits
slightly different code does not count as stale, while any change to the protocol does.

No ``_pb2_grpc`` service stubs are generated: both ends build their handlers and calls from the
service descriptor in ``parameter_server_pb2`` (:mod:`src.transport.grpc`), with serializers of their
own that count bytes and keep tensor bytes out of protobuf.
"""

from __future__ import annotations

import argparse
import sys

from src.transport.proto_stubs import ROOT, ProtocError, generate, stale_reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the committed stubs are current")
    args = parser.parse_args(argv)
    try:
        if args.check:
            reasons = stale_reasons()
            for reason in reasons:
                print(f"stale: {reason}; run python scripts/gen_protos.py", file=sys.stderr)
            return 1 if reasons else 0
        for path in generate():
            print(f"wrote {path.relative_to(ROOT)}")
    except ProtocError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
