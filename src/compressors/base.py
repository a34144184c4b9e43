"""The compressor interface, and reading any payload whatever compressor made it.

:class:`Compressor` is what every compressor implements (``compress`` -> payload bytes,
``decompress`` -> tensor, ``wire_size_for``); a concrete compressor registers its payload ``kind``
as it is defined, so :func:`parse_header`, :func:`decompress` and :func:`topk_entries` read any
payload by its header alone. The compressors are :mod:`src.compressors.identity`,
:mod:`src.compressors.topk` and :mod:`src.compressors.quantization`; their registry by name is
:mod:`src.compressors.registry` (imported by this package's face, so every kind is known wherever
a compressor module is imported). No I/O.
"""

from __future__ import annotations

import abc
import sys
import types
import warnings
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch

from src.compressors.checks import all_finite, check_numel, prepare_input, resolve_generator
from src.compressors.payload_format import (
    HEADER_SIZE,
    Kind,
    PayloadHeader,
    PayloadLike,
    as_buffer,
    read_header,
    value_bits,
)

_BY_KIND: dict[Kind, type[Compressor]] = {}
"""Compressor classes by payload kind, filled as each is defined (:meth:`Compressor.__init_subclass__`)."""


def registered_kinds() -> Mapping[Kind, type[Compressor]]:
    """The compressor of each payload kind defined so far (read-only)."""
    return types.MappingProxyType(_BY_KIND)


# --------------------------------------------------------------------------------------------
# Reading any payload
# --------------------------------------------------------------------------------------------


def parse_header(payload: PayloadLike) -> PayloadHeader:
    """Decode and validate the header of ``payload``, including that its length matches.

    Args:
        payload: a payload produced by any compressor's ``compress``.

    Returns:
        The decoded :class:`PayloadHeader`.

    Raises:
        ValueError: bad magic/version/checksum, unknown kind or dtype, inconsistent shape, or a
            payload shorter (truncated) or longer (extended) than the header says.
    """
    return read_header(as_buffer(payload), _checked_body_size)


def decompress(
    payload: PayloadLike,
    *,
    device: torch.device | str | None = None,
    copy: bool = True,
    header: PayloadHeader | None = None,
    finite_values: int = 0,
) -> torch.Tensor:
    """Rebuild the dense float32 tensor from any compressor's payload.

    The header names the compressor, so a receiver needs no other information: a push that the
    sender's policy left uncompressed (identity) decodes the same way.

    Args:
        payload: the bytes produced by ``compress`` (or a 1-D uint8 array/tensor view of them).
        device: where to put the result (default CPU).
        copy: ``False`` lets a float32 identity payload come back as a read-only view of
            ``payload``'s values (no copy; the payload must stay alive and nobody may write the tensor):
            what a receiver that only reads the gradient, like the parameter server, wants.
        header: what :func:`parse_header` returned for this very payload, when the caller checked it
            first (a receiver bounding the allocation by the header's shape): it is not parsed twice.
        finite_values: how many of the leading values the caller has checked finite already (a receiver
            that checks a payload's values as they arrive); only the rest are checked. Used by the
            ``copy=False`` view of a float32 identity payload, the one decode that checks values in place.

    Returns:
        A float32 tensor of the compressed tensor's shape; new and writable unless ``copy=False``.

    Raises:
        ValueError: the payload is malformed (see :func:`parse_header`) or its buffers are
            (out-of-range indices or codes, non-finite values).
    """
    buf = as_buffer(payload)
    if header is None:
        header = read_header(buf, _checked_body_size)
    if not copy and header.kind == Kind.IDENTITY and header.value_dtype == torch.float32 and sys.byteorder == "little":
        flat = _identity_view(header, buf, finite_values)
    else:
        flat = _BY_KIND[header.kind]._decode(header, buf)
    out = flat.reshape(header.shape)
    return out if device is None else out.to(device)


def topk_entries(payload: PayloadLike) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept entries of a top-k payload: (positions, int32 and strictly increasing; float32 values), checked
    as :func:`decompress` checks them; ``None`` for a payload of another kind (decompress that one).

    What a receiver that only adds the payload into a dense tensor needs: its ``k`` entries, not a dense
    tensor of zeros around them (:mod:`src.ddp.compressed_exchange`).

    Raises:
        ValueError: the payload is malformed, as :func:`decompress` says.
    """
    buf = as_buffer(payload)
    header = read_header(buf, _checked_body_size)
    if header.kind != Kind.TOPK:
        return None
    return _BY_KIND[Kind.TOPK]._entries(header, buf)


def wire_size(payload: PayloadLike) -> int:
    """Bytes that cross the wire for ``payload``: simply its length (header included)."""
    return len(as_buffer(payload))


# torch.from_numpy warns (once per process) when handed a read-only array; the read-only view of
# decompress(copy=False) is one on purpose.
for _message in ("The given NumPy array is not writable", "The given buffer is not writable"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=__name__.replace(".", r"\."))


def _identity_view(header: PayloadHeader, buf: memoryview, finite_values: int = 0) -> torch.Tensor:
    """The float32 values of an identity payload as a read-only tensor over ``buf`` (no copy); the first
    ``finite_values`` were checked finite by the caller, the rest are checked here."""
    values = torch.frombuffer(buf, dtype=torch.float32, count=header.numel, offset=HEADER_SIZE)
    if finite_values < header.numel and not all_finite(values[max(finite_values, 0) :]):
        raise ValueError("identity payload holds NaN/Inf values")
    return values


def _use_host_path(flat: torch.Tensor) -> bool:
    """CPU tensors are compressed with single-threaded numpy kernels.

    torch's intra-op thread pool parallelises each elementwise op; when the cores are shared
    (DDP ranks, data loaders, the PS process) every op then waits on a descheduled thread,
    which made 8-bit quantization of 11M entries 10-20x slower (600-1400 ms instead of 70).
    numpy on cache-sized chunks is about as fast on an idle machine and only slows by the CPU
    share it loses. Tensors on accelerators keep torch kernels. (Tests switch this off to run
    the torch path on CPU.)
    """
    return flat.device.type == "cpu"


def _checked_body_size(kind: Kind, *, bits: int, numel: int, param: int, value_dtype: torch.dtype) -> int:
    """Body bytes of a ``kind`` payload; ValueError when the header's fields are impossible for that kind."""
    cls = _BY_KIND[kind]
    cls._check_header(bits=bits, numel=numel, param=param, value_dtype=value_dtype)
    return cls._body_size(bits=bits, numel=numel, param=param)


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


class Compressor(abc.ABC):
    """Interface shared by every compressor: stateless, the payload is the wire message.

    Subclasses are frozen dataclasses whose fields are their configuration; the registry name
    is ``name`` and the header code ``kind``.
    """

    name: ClassVar[str]
    kind: ClassVar[Kind]

    def __init_subclass__(cls, **kwargs):
        """A concrete compressor names its ``kind``: the readers below decode that kind's payloads with it."""
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            if cls.kind in _BY_KIND:
                raise RuntimeError(f"two compressors for {cls.kind}: {_BY_KIND[cls.kind].__name__}, {cls.__name__}")
            _BY_KIND[cls.kind] = cls

    def compress(
        self, tensor: torch.Tensor, generator: torch.Generator | None = None, *, seed: int | None = None
    ) -> bytes:
        """Compress ``tensor`` into the bytes to send.

        Args:
            tensor: a dense floating tensor (float16/bfloat16/float64 are converted to float32).
            generator: RNG for stochastic compressors (quantization), on the tensor's device;
                default: torch's global RNG. Deterministic compressors ignore it.
            seed: alternative to ``generator``: seeds a fresh generator for this call.

        Returns:
            The payload: fixed header + buffers. ``len(payload)`` is the wire size and equals
            ``self.wire_size_for(tensor.numel())``.

        Raises:
            ValueError: non-tensor, non-floating dtype, empty tensor, NaN/Inf values, more than
                ``MAX_NDIM`` dimensions.
        """
        flat, shape, source_dtype = prepare_input(tensor)
        gen = resolve_generator(generator, seed, flat.device)
        return self._encode(flat, shape, source_dtype, gen)

    def decompress(self, payload: PayloadLike, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense float32 tensor from a payload; same as the module-level :func:`decompress`.

        The header is authoritative, so this also decodes payloads of other kinds (e.g. the
        identity payloads a :class:`CompressionPolicy` sends during warm-up).
        """
        return decompress(payload, device=device)

    def wire_size_for(self, numel: int) -> int:
        """Exact payload length in bytes (header included) for a tensor of ``numel`` entries.

        It depends on the configuration and ``numel`` only, so every DDP rank's payload for a
        bucket has the same length and ``all_gather`` needs no padding.
        """
        numel = check_numel(numel)
        return HEADER_SIZE + self._body_size(bits=self._bits(), numel=numel, param=self._param(numel))

    def compression_rate(self, numel: int) -> float:
        """Identity wire bytes / this compressor's wire bytes for ``numel`` entries."""
        return _BY_KIND[Kind.IDENTITY]().wire_size_for(numel) / self.wire_size_for(numel)

    # -- subclass hooks --------------------------------------------------------------------

    @staticmethod
    def _on_host(flat: torch.Tensor) -> bool:
        """Whether ``flat`` is compressed by the host (numpy) kernels: :func:`_use_host_path`."""
        return _use_host_path(flat)

    @abc.abstractmethod
    def _encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], source_dtype: torch.dtype, generator: torch.Generator | None
    ) -> bytes:
        raise NotImplementedError

    @abc.abstractmethod
    def _bits(self) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def _param(self, numel: int) -> int:
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _check_header(cls, *, bits: int, numel: int, param: int, value_dtype: torch.dtype) -> None:
        """Raise ValueError when header fields are impossible for this kind."""
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _body_size(cls, *, bits: int, numel: int, param: int) -> int:
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def _decode(cls, header: PayloadHeader, buf: memoryview) -> torch.Tensor:
        """Flat float32 CPU tensor of ``header.numel`` entries from a length-checked payload."""
        raise NotImplementedError


def check_value_bits(kind: str, bits: int, value_dtype: torch.dtype) -> None:
    """ValueError when a header's ``bits`` is not the width of its value dtype."""
    if bits != value_bits(value_dtype):
        raise ValueError(f"malformed {kind} payload header: bits={bits} for {value_dtype} values")
