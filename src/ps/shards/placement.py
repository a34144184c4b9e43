"""Where each of the model's tensors lives when the parameter server is split across several shards.

A :class:`Placement` is computed from the model's layout (names, element counts and element sizes, in the
model's own order) and the number of shards, and from nothing else: every process (each shard, each worker,
the launcher, the virtual run) computes the same one from the same model.

The rule (ps-lite's key ranges and MXNet's big-array slicing, BytePS's 4 MB partitions and its per-server byte
count): a tensor of more than ``slice_bytes`` is cut into nearly equal contiguous pieces of at most
``slice_bytes`` each (of its flattened elements), as many as a multiple of the shards (MXNet cuts a big array into
one slice per server), so every shard takes the same share of it; then the pieces and the whole tensors, largest
first (ties in the layout's order), each go to the shard holding the fewest bytes so far (ties to the lowest
shard). So a cut tensor is spread evenly, only the whole tensors (each at most the slice size) can leave the
shards uneven, and largest-first to the lightest keeps that within 4/3 of the best balance; a tensor no larger
than the slice size travels whole to one shard. (Cutting into pieces of the slice size alone left wide_mlp's two
big tensors, 13 and 11 pieces of 1 MB, on 16 shards at an imbalance of 1.49.)

Pure: no I/O and no torch; :meth:`Placement.split` and :meth:`Placement.assemble` work on anything that
slices like a flat sequence (a flattened tensor, a list, a numpy array).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

DEFAULT_SLICE_BYTES = 4 << 20
"""A tensor above this many bytes is cut across shards (BytePS's partition size)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the model's layout: its name, element count and bytes per element."""

    name: str
    numel: int
    element_size: int = 4

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of the flattened tensor ``name``, held by ``shard``; ``part`` numbers the
    tensor's pieces from 0 (a whole tensor is its only part, 0 of 1)."""

    name: str
    shard: int
    start: int
    stop: int
    part: int
    parts: int
    element_size: int = 4

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def key(self) -> str:
        """The slice's name on the wire and in a shard's checkpoint: the tensor's, with ``#part`` when cut."""
        return self.name if self.parts == 1 else f"{self.name}#{self.part}"


@dataclass(frozen=True)
class Placement:
    """The model's tensors over ``num_shards`` shards (see the module docstring)."""

    num_shards: int
    slice_bytes: int
    slices: tuple[Slice, ...]
    """Every slice, in the layout's order (a cut tensor's parts in order)."""

    def on_shard(self, shard: int) -> list[Slice]:
        """The slices ``shard`` holds, in the layout's order."""
        self._check_shard(shard)
        return [s for s in self.slices if s.shard == shard]

    def of_tensor(self, name: str) -> list[Slice]:
        """The slices of tensor ``name``, in element order."""
        found = [s for s in self.slices if s.name == name]
        if not found:
            raise KeyError(f"no tensor {name!r} in the placement")
        return found

    def bytes_per_shard(self) -> list[int]:
        """Bytes held by each shard."""
        totals = [0] * self.num_shards
        for s in self.slices:
            totals[s.shard] += s.nbytes
        return totals

    def imbalance(self) -> float:
        """The heaviest shard's bytes over the mean (1.0 is perfect balance)."""
        totals = self.bytes_per_shard()
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean else 1.0

    def split(self, flat: Mapping[str, Any], shard: int) -> list[tuple[Slice, Any]]:
        """``shard``'s slices of the flattened tensors in ``flat`` (name -> flat sequence), as views where
        the sequence slices as a view (a tensor's ``view(-1)``)."""
        return [(s, flat[s.name][s.start : s.stop]) for s in self.on_shard(shard)]

    def assemble(self, parts: Mapping[str, Any], concatenate: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """The whole flattened tensors from their slices: ``parts`` maps each slice's :attr:`Slice.key` to its
        elements, ``concatenate`` joins a cut tensor's pieces in order (``torch.cat``)."""
        missing = [s.key for s in self.slices if s.key not in parts]
        if missing:
            raise KeyError(f"slices missing from the parts to assemble: {', '.join(missing[:5])}")
        whole: dict[str, Any] = {}
        for s in self.slices:
            if s.parts == 1:
                whole[s.name] = parts[s.key]
            elif s.part == s.parts - 1:
                whole[s.name] = concatenate([parts[p.key] for p in self.of_tensor(s.name)])
        return whole

    def describe(self) -> dict[str, Any]:
        """What ``run_start`` and the summary record: shards, slice size, bytes per shard, imbalance, and
        each shard's slices by key."""
        return {
            "num_shards": self.num_shards,
            "slice_bytes": self.slice_bytes,
            "bytes_per_shard": self.bytes_per_shard(),
            "imbalance": round(self.imbalance(), 6),
            "slices_per_shard": [[s.key for s in self.on_shard(k)] for k in range(self.num_shards)],
        }

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ValueError(
                f"shard {shard} is not one of the placement's {self.num_shards} (0 to {self.num_shards - 1})"
            )


def place(layout: Iterable[TensorEntry], num_shards: int, slice_bytes: int = DEFAULT_SLICE_BYTES) -> Placement:
    """The placement of ``layout`` (in the model's order) over ``num_shards`` shards (see the module docstring)."""
    if num_shards < 1:
        raise ValueError(f"the number of shards must be at least 1, got {num_shards}")
    if slice_bytes < 1:
        raise ValueError(f"the slice size must be at least 1 byte, got {slice_bytes}")
    entries = list(layout)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("the layout names a tensor twice")
    pieces: list[tuple[int, int, Slice]] = []  # (order in the layout, part, slice without its shard)
    for order, entry in enumerate(entries):
        parts = 1
        if num_shards > 1 and entry.nbytes > slice_bytes:  # a multiple of the shards: each gets its share
            parts = math.ceil(math.ceil(entry.nbytes / slice_bytes) / num_shards) * num_shards
        bounds = _cuts(entry.numel, parts)
        for part in range(parts):
            piece = Slice(entry.name, -1, bounds[part], bounds[part + 1], part, parts, entry.element_size)
            pieces.append((order, part, piece))
    load = [0] * num_shards
    shard_of: dict[tuple[int, int], int] = {}
    for order, part, piece in sorted(pieces, key=lambda p: (-p[2].nbytes, p[0], p[1])):
        shard = min(range(num_shards), key=lambda k: (load[k], k))
        load[shard] += piece.nbytes
        shard_of[(order, part)] = shard
    slices = tuple(
        Slice(p.name, shard_of[(order, part)], p.start, p.stop, p.part, p.parts, p.element_size)
        for order, part, p in pieces
    )
    return Placement(num_shards, slice_bytes, slices)


def _cuts(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` nearly equal contiguous pieces of ``numel`` elements (the first ones larger)."""
    size, extra = divmod(numel, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (1 if part < extra else 0))
    return bounds


def layout_of(named: Sequence[tuple[str, Any]]) -> list[TensorEntry]:
    """The layout of named tensors (anything with ``numel()`` and ``element_size()``), in their order."""
    return [TensorEntry(name, int(t.numel()), int(t.element_size())) for name, t in named]
