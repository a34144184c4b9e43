"""A push cut by the shards' placement (src/ps/worker/codec.py): each shard's slices decode back to the gradient,
compression and error feedback are per slice, and a shard's rejection rolls back its slices only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from src.compression import TopKCompressor, decompress
from src.compressors.policy import CompressionPolicy
from src.ps.shards.placement import layout_of, place
from src.ps.worker.codec import PushCodec, shard_gradients

ASYNC_HARD = SimpleNamespace(aggregation_mode="async", staleness_policy="hard")


def _gradients(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"conv.weight": (16, 8, 3, 3), "fc.weight": (10, 120), "fc.bias": (10,), "big.weight": (64, 64)}
    return [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]


def _placement(gradients, shards=2):
    # 4 KB slices: big.weight (16 KB) is cut into 4 pieces across the shards.
    return place(layout_of(gradients), shards, slice_bytes=4096)


def _codec(policy, placement, *, error_feedback=True):
    names = [name for name, _ in _gradients()]
    return PushCodec(
        ASYNC_HARD, policy, error_feedback=error_feedback, seed=0, worker_id=0, names=names, placement=placement
    )


def test_each_shards_slices_decode_back_to_the_whole_gradient():
    gradients = _gradients()
    placement = _placement(gradients)
    sharded = _codec(None, placement, error_feedback=False)
    payloads = sharded.encode(gradients, step=0)
    assert [len(p) for p in payloads] == [len(keys) for keys in sharded.keys]
    parts = {}
    for shard, shard_payloads in enumerate(payloads):
        for piece, payload in zip(placement.on_shard(shard), shard_payloads):
            parts[piece.key] = decompress(b"".join(bytes(b) for b in payload) if isinstance(payload, list) else payload)
    whole = placement.assemble(parts, torch.cat)
    assert all(torch.equal(whole[name], gradient.reshape(-1)) for name, gradient in gradients)
    assert len(placement.of_tensor("big.weight")) == 4


def test_top_k_keeps_its_share_of_every_slice():
    gradients = _gradients()
    placement = _placement(gradients)
    topk = TopKCompressor(ratio=0.1)
    sharded = _codec(CompressionPolicy(topk), placement)
    payloads = sharded.encode(gradients, step=0)
    for shard, shard_payloads in enumerate(payloads):
        for piece, payload in zip(placement.on_shard(shard), shard_payloads):
            kept = int(torch.count_nonzero(decompress(payload)))
            if piece.key != "fc.bias":  # 10 entries: identity beats top-k's header
                assert kept == topk.k_for(piece.numel) == math.ceil(0.1 * piece.numel), (piece.key, kept)
                assert len(payload) == topk.wire_size_for(piece.numel)


def test_a_rejection_by_one_shard_rolls_back_its_slices_only_and_no_mass_is_lost():
    gradients = _gradients()
    placement = _placement(gradients)
    codec = sharded = _codec(CompressionPolicy(TopKCompressor(ratio=0.1)), placement)
    payloads = sharded.encode(gradients, step=0)
    sharded.settle(0, accepted=True)
    sharded.settle(1, accepted=False)
    flat = {name: gradient.reshape(-1) for name, gradient in gradients}
    for shard, shard_payloads in enumerate(payloads):
        for piece, payload in zip(placement.on_shard(shard), shard_payloads):
            original = flat[piece.name][piece.start : piece.stop]
            residual = codec.feedback.residual(piece.key)
            if shard == 1:  # rejected: the whole compensated slice is back in its residual
                assert torch.equal(residual, original)
            else:  # accepted: what was sent plus what was left out is the slice
                assert torch.allclose(decompress(payload) + residual, original, atol=1e-6)
    # The next push of shard 1 carries the rejected gradient again, compensated.
    again = shard_gradients(placement, [(name, torch.zeros_like(g)) for name, g in gradients])
    compensated = codec.feedback.compensate(again[1][0][0], again[1][0][1])
    key = again[1][0][0]
    piece = next(s for s in placement.slices if s.key == key)
    assert torch.equal(compensated, flat[piece.name][piece.start : piece.stop])


def test_a_gradient_missing_from_the_placement_is_named():
    gradients = _gradients()
    placement = _placement(gradients)
    with pytest.raises(KeyError, match="big.weight"):
        shard_gradients(placement, [g for g in gradients if g[0] != "big.weight"])
