"""The parameter server's gRPC stubs, generated from ``protos/parameter_server.proto``, and whether they are current.

The proto is compiled under the virtual path ``src/parameter_server.proto`` (``-Isrc=protos``), so
the generated modules import each other as ``from src import ...`` without patching their text.
The check compares descriptors, not file text, so a different grpcio-tools version that emits
slightly different code does not count as stale, while any change to the protocol does.

No ``_pb2_grpc`` service stubs are generated: both ends build their handlers and calls from the
service descriptor in ``parameter_server_pb2`` (:mod:`src.transport.grpc`), with serializers of their
own that count bytes and keep tensor bytes out of protobuf. The command: ``scripts/gen_protos.py``.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "protos" / "parameter_server.proto"
GENERATED = ("parameter_server_pb2.py", "parameter_server_pb2.pyi")


class ProtocError(RuntimeError):
    """protoc did not compile the proto (its own messages are on stderr)."""


def _protoc(proto: Path, *args: str) -> None:
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    status = protoc.main(["grpc_tools.protoc", f"-I{include}", f"-Isrc={proto.parent}", *args, f"src/{proto.name}"])
    if status != 0:
        raise ProtocError(f"protoc failed on {proto} (status {status})")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Compile the proto into ``<out_root>/src``; returns the files written."""
    (out_root / "src").mkdir(parents=True, exist_ok=True)
    _protoc(PROTO, f"--python_out={out_root}", f"--pyi_out={out_root}")
    return [out_root / "src" / name for name in GENERATED]


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def stale_reasons(proto: Path = PROTO) -> list[str]:
    """Why the committed stubs do not match ``proto`` (empty when they are current)."""
    from google.protobuf import descriptor_pb2

    missing = [name for name in GENERATED if not (ROOT / "src" / name).is_file()]
    if missing:
        return [f"src/{name} is missing" for name in missing]
    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = Path(tmp) / "set.pb"
        _protoc(proto, f"--descriptor_set_out={descriptor_set}")
        expected = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file[0]
    _drop_json_names(expected.message_type)  # protoc adds them to descriptor sets, not to gencode
    committed_module = importlib.import_module("src.parameter_server_pb2")
    committed = descriptor_pb2.FileDescriptorProto.FromString(committed_module.DESCRIPTOR.serialized_pb)
    reasons = []
    if committed != expected:
        reasons.append("src/parameter_server_pb2.py was generated from a different parameter_server.proto")
    return reasons
