"""The checks every compressor shares: what ``compress`` accepts, and finite values in one pass.

A tensor to compress must be a dense floating tensor of at most ``MAX_NDIM`` dimensions with
finite values; a generator or a seed drives stochastic rounding; sizes are positive ints. Each
check raises ``ValueError`` naming the problem. :func:`all_finite` also guards the decoders:
no payload may yield a silently wrong tensor. No I/O; torch, numpy and the standard library only.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Union

import numpy as np
import torch

from src.compressors.payload_format import DTYPE_CODES, MAX_NDIM, UINT32_MAX

# all_finite reads received payloads (read-only arrays) through torch views it never writes.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__.replace(".", r"\.")
)


def prepare_input(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype]:
    """Validate a tensor to compress; return it flat, float32, contiguous (a view when possible).

    Finiteness is checked later, fused into each compressor's own pass over the values.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"compress expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"compress expects a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.dtype not in DTYPE_CODES:
        raise ValueError(
            f"compress expects a floating-point tensor (float32, float16, bfloat16 or float64), "
            f"got dtype {tensor.dtype}"
        )
    if tensor.numel() == 0:
        raise ValueError(f"cannot compress an empty tensor (shape {tuple(tensor.shape)})")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot compress a tensor with {len(shape)} dimensions; the header holds at most {MAX_NDIM}")
    if max(shape, default=1) > UINT32_MAX:
        raise ValueError(f"cannot compress shape {shape}: each dimension must be < 2**32")
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
    return flat, shape, tensor.dtype


def raise_non_finite(flat: torch.Tensor, shape: tuple[int, ...], source_dtype: torch.dtype) -> None:
    nans, infs = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    extra = "" if source_dtype == torch.float32 else " (after conversion to float32)"
    raise ValueError(
        f"cannot compress a tensor of shape {shape} holding non-finite values: {nans} NaN and {infs} Inf{extra}"
    )


def all_finite(values: Union[np.ndarray, torch.Tensor]) -> bool:
    # One pass: NaN and +-Inf make the sum non-finite, so a finite sum proves every value finite.
    # Finite values can also overflow the sum; only then does the exact check (min/max) decide.
    if isinstance(values, np.ndarray) and values.dtype.kind == "f" and values.dtype.isnative:
        values = torch.from_numpy(values)  # a view: torch's sum is 2-3x numpy's and indifferent to alignment
    if isinstance(values, torch.Tensor):
        if math.isfinite(values.sum().item()):
            return True
        lo, hi = torch.aminmax(values)
        return math.isfinite(lo.item()) and math.isfinite(hi.item())
    with np.errstate(over="ignore", invalid="ignore"):
        total = values.sum()
    return bool(np.isfinite(total)) or (math.isfinite(values.min()) and math.isfinite(values.max()))


def resolve_generator(
    generator: torch.Generator | None, seed: int | None, device: torch.device
) -> torch.Generator | None:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed to compress, not both")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None:
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


def check_numel(numel: Any) -> int:
    if not isinstance(numel, numbers.Integral) or isinstance(numel, bool) or numel <= 0:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    return int(numel)
