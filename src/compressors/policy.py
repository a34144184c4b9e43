"""Warm-up and skipping: which compressor a send uses, and the compression a run's config asks for.

:class:`CompressionPolicy` sends identity (uncompressed) for the first ``warmup_steps`` steps and
for tensors the compressor would not shrink enough (``min_compression_rate``), the configured
compressor otherwise; :func:`policy_from_config` builds it from a ``system`` config section.
Receivers decode every payload alike with ``src.compression.decompress``. No I/O.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

import torch

from src.compressors.base import Compressor, decompress
from src.compressors.identity import IDENTITY, IdentityCompressor
from src.compressors.payload_format import PayloadLike
from src.compressors.registry import build_compressor


@dataclasses.dataclass(frozen=True)
class CompressionPolicy:
    """Chooses per send between the configured compressor and identity.

    Identity is used while ``step < warmup_steps`` (dense updates early in training, as PowerSGD
    does) and for tensors the compressor would not shrink enough: the compressor is used only
    when identity's payload is more than ``min_compression_rate`` times the compressor's. With
    the default 1.0 that means "skip only when compressing would not make the payload smaller"
    (tiny biases, whose 56-byte header dominates). That identity sends its values in the
    compressor's ``value_dtype`` (float32 for quantization), so a run that asks for 16-bit values
    gets them in every payload. Receivers decode either with :func:`decompress`.

    Attributes:
        compressor: the compressor used after warm-up.
        warmup_steps: number of initial steps (0-based ``step < warmup_steps``) sent uncompressed.
        min_compression_rate: identity bytes / compressed bytes the compressor must beat.
    """

    compressor: Compressor
    warmup_steps: int = 0
    min_compression_rate: float = 1.0

    def __post_init__(self):
        if not isinstance(self.compressor, Compressor):
            raise ValueError(f"policy.compressor must be a Compressor, got {type(self.compressor).__name__}")
        steps = self.warmup_steps
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"policy.warmup_steps must be an int >= 0, got {steps!r}")
        rate = self.min_compression_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"policy.min_compression_rate must be a finite number >= 0, got {rate!r}")

    @property
    def identity(self) -> IdentityCompressor:
        """What goes uncompressed: identity in the compressor's value dtype."""
        value_dtype = getattr(self.compressor, "value_dtype", torch.float32)
        return IDENTITY if value_dtype == torch.float32 else IdentityCompressor(value_dtype)

    def compressor_for(self, step: int, numel: int) -> Compressor:
        """The compressor to use at ``step`` for a tensor of ``numel`` entries."""
        identity = self.identity
        if step < self.warmup_steps:
            return identity
        if identity.wire_size_for(numel) / self.compressor.wire_size_for(numel) <= self.min_compression_rate:
            return identity
        return self.compressor

    def compress(
        self, tensor: torch.Tensor, step: int, generator: torch.Generator | None = None, *, seed: int | None = None
    ) -> bytes:
        """Compress ``tensor`` with :meth:`compressor_for` ``(step, tensor.numel())``."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"compress expects a torch.Tensor, got {type(tensor).__name__}")
        numel = tensor.numel()
        chosen = self.compressor_for(step, numel) if numel else self.compressor
        return chosen.compress(tensor, generator, seed=seed)

    @staticmethod
    def decompress(payload: PayloadLike, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Same as the module-level :func:`decompress`."""
        return decompress(payload, device=device)


# Config field names that configure each compressor, read from a ``system`` config section.
_SETTINGS_FROM_CONFIG: Mapping[str, Any] = types.MappingProxyType(
    {
        "topk": lambda system: {
            "ratio": system.compression_ratio,
            "selection": system.topk_selection,
            # a section from before 16-bit values existed reads as float32
            "value_dtype": getattr(system, "compression_value_dtype", "float32"),
        },
        "quantization": lambda system: {
            "bits": system.quantization_bits,
            "bucket_size": system.quantization_bucket_size,
        },
    }
)


def policy_from_config(system: Any) -> "CompressionPolicy | None":
    """The compression a run's ``system`` config section asks for, or ``None`` when disabled.

    ``system`` is read by attribute (``src.config.SystemConfig``: ``compression_enabled``,
    ``compression_type``, ``compression_ratio``, ``topk_selection``, ``compression_value_dtype``,
    ``quantization_bits``, ``quantization_bucket_size``, ``warmup_steps``), so this module stays
    free of the config layer.

    Raises:
        ValueError: unknown ``compression_type`` or a bad setting (naming the field).
    """
    if not system.compression_enabled:
        return None
    try:
        settings = _SETTINGS_FROM_CONFIG[system.compression_type](system)
    except KeyError:
        raise ValueError(
            f"system.compression_type: must be one of {sorted(_SETTINGS_FROM_CONFIG)}, got {system.compression_type!r}"
        ) from None
    compressor = build_compressor(system.compression_type, **settings)
    return CompressionPolicy(compressor, warmup_steps=system.warmup_steps)
