"""Gradient compression: stateless compressors whose output is the exact bytes sent on the wire.

What it is for
--------------
One algorithm module shared by the gRPC parameter server (payloads go straight into a protobuf
``bytes`` field), the DDP communication hooks (``torch.frombuffer(payload, dtype=torch.uint8)``
goes into ``all_gather``) and a user's own training loop. It does no I/O and imports nothing but
torch, numpy, the standard library and the modules of its family (below).

    c = build_compressor("topk", ratio=0.01)           # or "quantization", "identity"
    ef = ErrorFeedback()
    compensated = ef.compensate("fc.weight", grad)     # grad + residual
    payload = c.compress(compensated)                  # bytes; len(payload) is the wire size
    ef.update("fc.weight", compensated, payload)       # residual = compensated - what was sent
    ...                                                # push rejected: ef.rollback("fc.weight")
    dense = decompress(payload)                        # receiver: the header says everything

This module is the face of ``src/compressors/``: it hands on the compressors (the :class:`Compressor`
interface, identity, top-k, quantization), their registry (:func:`build_compressor`), the readers of
any payload (:func:`parse_header`, :func:`decompress`, :func:`wire_size`), error feedback and the
compression policy. The folder, one concept per module:

* ``base.py``                the :class:`Compressor` interface; reading any payload.
* ``identity.py``, ``topk.py``, ``quantization.py``: the three compressors.
* ``registry.py``            the compressors by name, checked complete; ``build_compressor``.
* ``payload_format.py``      the 56-byte header, its codes, and values in 32 or 16 bits.
* ``checks.py``              what ``compress`` accepts; finite values in one pass.
* ``topk_selection.py``      which entries top-k keeps (exact or sampled threshold).
* ``quantization_codes.py``  QSGD scales, stochastic rounding and the 2/4/8-bit packing.
* ``error_feedback.py``      :class:`ErrorFeedback`: residuals, rollback.
* ``policy.py``              :class:`CompressionPolicy` (warm-up, skipping small tensors) and
  ``policy_from_config``.

Every payload is ``HEADER_SIZE`` (56) bytes of fixed header followed by the compressor's buffers:

* ``identity``      4 bytes per entry (raw float32): the uncompressed reference.
* ``topk``          8 bytes per kept entry (float32 value + int32 index),
                    ``k = ceil(ratio * numel)``.
* identity and top-k with ``value_dtype="bfloat16"`` or ``"float16"``: 2 bytes per value, so
                    6 bytes per kept top-k entry (0.75x the float32 payload's body).
* ``quantization``  ``bits / 8`` bytes per entry + one float32 scale per bucket
                    (8 bits: 1 byte per entry, the default).

The layout, costs and algorithms are described in ``docs/compression.md``.

How to tune it
--------------
* ``topk.ratio``: fraction of entries kept. 0.01 sends ~2% of the identity bytes (8 B per kept
  entry against 4 B per entry); pair it with :class:`ErrorFeedback` or training degrades.
* ``topk.selection``: ``"sampled"`` (default) estimates the magnitude threshold from a fixed-seed
  sample and then corrects it, so it returns *exactly the same entries* as ``"exact"``
  (``torch.topk``) but ~9x faster at 1M entries and 15-20x at 11M. Use ``"exact"`` only to
  rule it out.
* ``topk.value_dtype`` / ``identity.value_dtype``: ``"float32"`` (default), ``"bfloat16"`` or
  ``"float16"``: the precision the values travel in. bfloat16 keeps float32's range (7 mantissa
  bits: relative rounding error <= 2**-8); float16 has 10 mantissa bits but saturates at +-65504.
  The rounding error is what :class:`ErrorFeedback` carries into the next step, like the entries
  top-k drops.
* ``topk.sample_size``: sample drawn for the threshold estimate (raised automatically so the
  sample holds at least 256 expected top-k hits). Larger is steadier, smaller is cheaper.
* ``quantization.bits``: 8 (1 B/entry, ~4x), 4 (~8x) or 2 (~16x, ternary). Fewer bits means more
  variance; the QSGD bound is ``E||Q(x)-x||^2 <= min(n/s^2, sqrt(n)/s) ||x||^2`` per bucket of
  ``n`` entries with ``s = 2**(bits-1) - 1`` levels.
* ``quantization.bucket_size``: entries sharing one float32 scale (default 512). Smaller buckets
  cut variance (the scale tracks local magnitude) at 4 bytes per bucket.
* :class:`CompressionPolicy` ``warmup_steps`` sends uncompressed for the first steps and
  ``min_compression_rate`` sends small tensors (biases) uncompressed when compressing would not
  pay for itself.

Inputs in float16, bfloat16 or float64 are converted to float32 before compressing (the header
records the source dtype); :func:`decompress` always returns float32, whatever dtype the values
travelled in. Bad input -- non-finite
values, empty tensors, non-floating dtypes, payloads whose header is garbled or disagrees with the
payload length -- raises ``ValueError`` naming the problem; it never yields a silently wrong tensor.
"""

from src.compressors.base import Compressor, decompress, parse_header, topk_entries, wire_size
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.identity import IDENTITY, IdentityCompressor
from src.compressors.payload_format import (
    BYTES_PER_IDENTITY_ENTRY,
    BYTES_PER_INDEX,
    BYTES_PER_SCALE,
    BYTES_PER_TOPK_ENTRY,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_NDIM,
    VALUE_DTYPES,
    Kind,
    PayloadHeader,
)
from src.compressors.policy import CompressionPolicy, policy_from_config
from src.compressors.quantization import QuantizationCompressor
from src.compressors.registry import COMPRESSORS, build_compressor
from src.compressors.topk import TopKCompressor

# The format's constants and PayloadHeader are handed on too: they are this face's documented API
# (``HEADER_SIZE`` above, ``docs/compression.md``), imported from here by the PS, the hooks and tests.
__all__ = [
    "BYTES_PER_IDENTITY_ENTRY",
    "BYTES_PER_INDEX",
    "BYTES_PER_SCALE",
    "BYTES_PER_TOPK_ENTRY",
    "COMPRESSORS",
    "CompressionPolicy",
    "Compressor",
    "ErrorFeedback",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "IDENTITY",
    "IdentityCompressor",
    "Kind",
    "MAGIC",
    "MAX_NDIM",
    "PayloadHeader",
    "QuantizationCompressor",
    "TopKCompressor",
    "VALUE_DTYPES",
    "build_compressor",
    "decompress",
    "parse_header",
    "policy_from_config",
    "topk_entries",
    "wire_size",
]
