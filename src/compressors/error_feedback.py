"""Error feedback: per-key residuals of what compression left out, added back to the next gradient.

Compressors are stateless; the memory of what they dropped (or rounded) lives here, keyed by
parameter name or DDP bucket index: ``compensate -> compress -> update``, and on a rejected push
``rollback`` puts the whole compensated gradient back into the residual, so no gradient mass is
ever lost (``discard`` forgets a lost push whose samples will be computed again). Residuals
checkpoint through :meth:`ErrorFeedback.state_dict`. No I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Union

import torch

from src.compressors.base import decompress
from src.compressors.payload_format import PayloadLike

_EF_STATE_VERSION = 1


def _check_key(key: Hashable) -> None:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise ValueError(f"error-feedback key must be a str or int (parameter name or bucket index), got {key!r}")


def _float_tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} must be a floating-point torch.Tensor, got {kind}")
    return value.detach().to(torch.float32)


class ErrorFeedback:
    """Per-key residuals: what compression left out is added back to the next gradient.

    Use per parameter (key = name) or per DDP bucket (key = bucket index)::

        compensated = ef.compensate(key, grad)        # grad + residual
        payload = compressor.compress(compensated)
        ef.update(key, compensated, payload)          # residual = compensated - sent
        # push rejected (e.g. too stale)?  ef.rollback(key): residual = compensated, nothing lost
        # push accepted?  optionally ef.commit(key) to drop the rollback copy early

    Invariant: after T steps, sum(transmitted) + residual == sum(gradients), and a rollback
    restores the residual to exactly the compensated tensor. ``update`` keeps a reference to
    ``compensated`` for the rollback, so do not modify it in place until the next
    ``update``/``rollback``/``commit`` of that key (``compensate`` always returns a fresh tensor).
    Residuals live on the device of the gradients they came from.
    """

    def __init__(self) -> None:
        self._residuals: dict[Union[str, int], torch.Tensor] = {}
        self._pending: dict[Union[str, int], torch.Tensor] = {}
        self._before: dict[Union[str, int], torch.Tensor | None] = {}

    def compensate(self, key: Union[str, int], grad: torch.Tensor) -> torch.Tensor:
        """Return a new float32 tensor ``grad + residual(key)`` (``grad`` copy if none yet).

        Raises:
            ValueError: bad key, non-floating grad, or a shape that differs from the residual's.
        """
        _check_key(key)
        grad = _float_tensor(grad, f"gradient for key {key!r}")
        residual = self._residuals.get(key)
        if residual is None:
            return grad.clone()
        if residual.shape != grad.shape:
            raise ValueError(
                f"gradient for key {key!r} has shape {tuple(grad.shape)} but its "
                f"residual has shape {tuple(residual.shape)}"
            )
        return grad + residual.to(grad.device)

    def update(
        self, key: Union[str, int], compensated: torch.Tensor, transmitted: Union[PayloadLike, torch.Tensor]
    ) -> torch.Tensor:
        """Record what was sent: residual = compensated - decompress(transmitted).

        Args:
            key: same key as in :meth:`compensate`.
            compensated: the tensor returned by :meth:`compensate` (the one compressed).
            transmitted: the payload bytes, or the already-decompressed float tensor (to avoid
                decompressing twice).

        Returns:
            The new residual.

        Raises:
            ValueError: bad key, bad payload, or shapes that do not match.
        """
        _check_key(key)
        compensated = _float_tensor(compensated, f"compensated tensor for key {key!r}")
        if isinstance(transmitted, torch.Tensor) and transmitted.dtype != torch.uint8:
            sent = _float_tensor(transmitted, f"transmitted tensor for key {key!r}")
        else:
            sent = decompress(transmitted)
        if sent.shape != compensated.shape:
            raise ValueError(
                f"transmitted tensor for key {key!r} has shape {tuple(sent.shape)} "
                f"but the compensated tensor has shape {tuple(compensated.shape)}"
            )
        residual = compensated - sent.to(compensated.device)
        self._before[key] = self._residuals.get(key)  # not modified in place: kept by reference for discard
        self._residuals[key] = residual
        self._pending[key] = compensated
        return residual

    def settle_sent_entries(
        self, key: Union[str, int], compensated: torch.Tensor, positions: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`update` then :meth:`commit` for a send known by its kept entries (a top-k payload's):
        residual = compensated less ``values`` at the flat ``positions``, the same sums as ``update``'s.

        ``compensated`` itself becomes the residual (changed in place: no new tensor, no pass over the
        entries not sent) and no rollback copy is kept: for a caller whose sends are never rejected (DDP).

        Returns:
            The new residual.

        Raises:
            ValueError: bad key or a non-float32 ``compensated``.
        """
        _check_key(key)
        if not isinstance(compensated, torch.Tensor) or compensated.dtype != torch.float32:
            raise ValueError(f"compensated tensor for key {key!r} must be a float32 torch.Tensor")
        flat = compensated.view(-1)
        flat.index_add_(0, positions, values, alpha=-1)  # distinct positions: x + (-v) is x - v, as compensated - sent
        self._residuals[key] = compensated
        self._pending.pop(key, None)
        self._before.pop(key, None)
        return compensated

    def rollback(self, key: Union[str, int]) -> None:
        """Undo the last :meth:`update` of ``key`` after a rejected push.

        The residual becomes the whole compensated tensor (previous residual + gradient).

        Raises:
            ValueError: no update of ``key`` is pending (never updated, already rolled back or
                committed).
        """
        _check_key(key)
        if key not in self._pending:
            raise ValueError(f"no pending update to roll back for key {key!r}")
        self._residuals[key] = self._pending.pop(key)
        self._before.pop(key, None)

    def discard(self, key: Union[str, int]) -> None:
        """Undo the last :meth:`compensate`/:meth:`update` of ``key`` entirely: the residual is what it was before.

        For a push that was lost (not rejected) and whose samples will be computed again: keeping
        its gradient in the residual would apply it twice.

        Raises:
            ValueError: no update of ``key`` is pending.
        """
        _check_key(key)
        if key not in self._pending:
            raise ValueError(f"no pending update to discard for key {key!r}")
        self._pending.pop(key)
        before = self._before.pop(key, None)
        if before is None:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = before

    def commit(self, key: Union[str, int]) -> None:
        """Forget the rollback copy of ``key`` once its push was accepted (frees memory)."""
        self._pending.pop(key, None)
        self._before.pop(key, None)

    def residual(self, key: Union[str, int]) -> torch.Tensor | None:
        """Current residual of ``key`` (None if it has none)."""
        return self._residuals.get(key)

    def keys(self) -> list[Union[str, int]]:
        """Keys that hold a residual."""
        return list(self._residuals)

    def reset(self) -> None:
        """Drop every residual and pending rollback."""
        self._residuals.clear()
        self._pending.clear()
        self._before.clear()

    def state_dict(self) -> dict[str, Any]:
        """Residuals (and pending rollbacks) as a plain dict of ints and tensors.

        Loadable with ``torch.load(..., weights_only=True)``.
        """
        return {
            "format_version": _EF_STATE_VERSION,
            "residuals": dict(self._residuals),
            "pending": dict(self._pending),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the residuals with those of a :meth:`state_dict`.

        Raises:
            ValueError: the state is not one produced by :meth:`state_dict`.
        """
        if not isinstance(state, Mapping) or state.get("format_version") != _EF_STATE_VERSION:
            raise ValueError(f"not an ErrorFeedback state_dict (format_version {_EF_STATE_VERSION} expected)")
        loaded: dict[str, dict] = {}
        for section in ("residuals", "pending"):
            entries = state.get(section, {})
            if not isinstance(entries, Mapping):
                raise ValueError(f"ErrorFeedback state_dict[{section!r}] must be a dict")
            for key, tensor in entries.items():
                _check_key(key)
                if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                    raise ValueError(f"ErrorFeedback state_dict[{section!r}][{key!r}] must be a float32 tensor")
            loaded[section] = dict(entries)
        self._residuals = loaded["residuals"]
        self._pending = loaded["pending"]
        self._before = {}
