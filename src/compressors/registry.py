"""The compressors by registry name (``identity``, ``topk``, ``quantization``), checked complete at import,
and :func:`build_compressor`, which builds one from its name and config-like options. No I/O.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from src.compressors.base import Compressor, registered_kinds
from src.compressors.identity import IdentityCompressor
from src.compressors.payload_format import Kind
from src.compressors.quantization import QuantizationCompressor
from src.compressors.topk import TopKCompressor

#: Compressor classes by registry name (read-only).
COMPRESSORS: Mapping[str, type[Compressor]] = types.MappingProxyType(
    {cls.name: cls for cls in (IdentityCompressor, TopKCompressor, QuantizationCompressor)}
)


def _check_registry() -> None:
    """Every Kind has exactly one compressor, named after it, and vice versa."""
    expected = {kind.name.lower(): kind for kind in Kind}
    actual = {name: cls.kind for name, cls in COMPRESSORS.items()}
    if actual != expected or dict(registered_kinds()) != {cls.kind: cls for cls in COMPRESSORS.values()}:
        raise RuntimeError(f"compressor registry incomplete: expected {expected}, got {actual}")


_check_registry()


def build_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build a compressor from its registry name and config-like keyword arguments.

    Args:
        name: ``"identity"``, ``"topk"`` or ``"quantization"``.
        **kwargs: that compressor's fields: topk: ``ratio``, ``selection``, ``sample_size``;
            quantization: ``bits``, ``bucket_size``; identity: none.

    Returns:
        The (stateless, immutable) compressor.

    Raises:
        ValueError: unknown name, unknown keyword, or an invalid value (the message names the
            field, e.g. ``topk.ratio``).
    """
    cls = COMPRESSORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; expected one of {sorted(COMPRESSORS)}")
    accepted = [field.name for field in dataclasses.fields(cls) if field.init]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for compressor {name!r}; accepted: {accepted or 'none'}")
    return cls(**kwargs)
