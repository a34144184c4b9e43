"""Error feedback (src/compressors/error_feedback.py): residuals conserve the gradient mass, a rejected push rolls
back exactly, its state survives a checkpoint, bad input is refused."""

from __future__ import annotations

import io

import pytest
import torch

from src.compression import (
    IDENTITY,
    build_compressor,
    decompress,
)
from src.compressors.error_feedback import ErrorFeedback

pytestmark = pytest.mark.timeout(120)


def _randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_settling_a_topk_send_by_its_entries_leaves_the_residual_update_and_commit_leave():
    from src.compression import topk_entries

    by_update, by_entries = ErrorFeedback(), ErrorFeedback()
    topk = build_compressor("topk", ratio=0.1)
    for step in range(3):
        grad = _randn((30, 20), seed=step)
        compensated = by_update.compensate("w", grad)
        payload = topk.compress(compensated)
        by_update.update("w", compensated, payload)
        by_update.commit("w")
        own = by_entries.compensate("w", grad)
        positions, values = topk_entries(payload)
        residual = by_entries.settle_sent_entries(
            "w", own, torch.from_numpy(positions.astype("int64")), torch.from_numpy(values)
        )
        assert residual is own and torch.equal(residual, by_update.residual("w"))  # the same sums, in place
        assert by_entries.residual("w") is own
    with pytest.raises(ValueError, match="no pending update"):
        by_entries.rollback("w")  # nothing kept to roll back to: for senders that are never refused


@pytest.mark.parametrize(
    "compressor",
    [build_compressor("topk", ratio=0.05), build_compressor("quantization", bits=2)],
    ids=["topk", "quant2"],
)
def test_error_feedback_conserves_mass(compressor):
    """sum(transmitted) + residual == sum(gradients), with rejected pushes rolled back."""
    ef = ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    total_grad = torch.zeros(40, 25, dtype=torch.float64)
    total_sent = torch.zeros_like(total_grad)
    for step in range(30):
        grad = torch.randn(40, 25, generator=gen)
        total_grad += grad.double()
        compensated = ef.compensate("layer.weight", grad)
        payload = compressor.compress(compensated, gen)
        ef.update("layer.weight", compensated, payload)
        if step % 7 == 3:  # push rejected: nothing was applied, nothing may be lost
            ef.rollback("layer.weight")
            assert torch.equal(ef.residual("layer.weight"), compensated)
        else:
            total_sent += decompress(payload).double()
    residual = ef.residual("layer.weight").double()
    torch.testing.assert_close(total_sent + residual, total_grad, rtol=0, atol=1e-4)


def test_rollback_restores_previous_residual_plus_grad_exactly():
    ef = ErrorFeedback()
    topk = build_compressor("topk", ratio=0.1)
    g1, g2 = _randn(200, seed=1), _randn(200, seed=2)
    c1 = ef.compensate(3, g1)  # int key: a DDP bucket index
    ef.update(3, c1, topk.compress(c1))
    previous = ef.residual(3).clone()
    c2 = ef.compensate(3, g2)
    sent = decompress(topk.compress(c2))
    ef.update(3, c2, sent)  # already-decompressed tensor accepted too
    ef.rollback(3)
    assert torch.equal(ef.residual(3), c2)
    assert torch.equal(ef.residual(3), g2 + previous)
    with pytest.raises(ValueError, match="no pending update"):
        ef.rollback(3)


def test_error_feedback_update_with_payload_or_tensor_agree():
    x = _randn(300, seed=4)
    quant = build_compressor("quantization", bits=4)
    payload = quant.compress(x, seed=0)
    a, b = ErrorFeedback(), ErrorFeedback()
    a.update("w", a.compensate("w", x), payload)
    b.update("w", b.compensate("w", x), decompress(payload))
    assert torch.equal(a.residual("w"), b.residual("w"))
    assert torch.equal(a.residual("w"), x - decompress(payload))


def test_error_feedback_bad_input():
    ef = ErrorFeedback()
    c = ef.compensate("w", torch.ones(4))
    ef.update("w", c, IDENTITY.compress(c * 0.5))
    with pytest.raises(ValueError, match="shape"):
        ef.compensate("w", torch.ones(5))
    with pytest.raises(ValueError, match="shape"):
        ef.update("w", torch.ones(4), torch.ones(3))
    with pytest.raises(ValueError, match="key must be a str or int"):
        ef.compensate(("a", 1), torch.ones(4))
    with pytest.raises(ValueError, match="floating-point"):
        ef.compensate("v", torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="no pending update"):
        ef.rollback("never-seen")
    with pytest.raises(ValueError, match="payload"):
        ef.update("w", torch.ones(4), b"garbage")


def test_error_feedback_compensate_returns_fresh_tensor_and_reset():
    ef = ErrorFeedback()
    grad = torch.ones(3)
    compensated = ef.compensate("w", grad)
    compensated += 1  # caller owns it: the gradient is untouched
    assert torch.equal(grad, torch.ones(3))
    ef.update("w", compensated, IDENTITY.compress(torch.zeros(3)))
    assert ef.keys() == ["w"]
    ef.reset()
    assert ef.keys() == [] and ef.residual("w") is None
    with pytest.raises(ValueError):
        ef.rollback("w")


def test_error_feedback_state_dict_round_trip(tmp_path):
    topk = build_compressor("topk", ratio=0.1)
    ef = ErrorFeedback()
    for key, seed in (("fc.weight", 1), (0, 2), (7, 3)):
        c = ef.compensate(key, _randn((6, 7), seed))
        ef.update(key, c, topk.compress(c))
    path = tmp_path / "ef.pt"
    torch.save({"error_feedback": ef.state_dict()}, path)
    state = torch.load(path, weights_only=True)["error_feedback"]
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert restored.keys() == ef.keys()
    for key in ef.keys():
        assert torch.equal(restored.residual(key), ef.residual(key))
    # The pending rollback survives too, and both continue identically.
    restored.rollback(0)
    ef.rollback(0)
    grad = _randn((6, 7), seed=9)
    assert torch.equal(restored.compensate(0, grad), ef.compensate(0, grad))
    buffer = io.BytesIO()
    torch.save(ErrorFeedback().state_dict(), buffer)
    buffer.seek(0)
    empty = ErrorFeedback()
    empty.load_state_dict(torch.load(buffer, weights_only=True))
    assert empty.keys() == []


def test_error_feedback_load_state_dict_rejects_garbage():
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="not an ErrorFeedback state_dict"):
        ef.load_state_dict({"residuals": {}})
    with pytest.raises(ValueError, match="float32 tensor"):
        ef.load_state_dict({"format_version": 1, "residuals": {"w": [1.0]}, "pending": {}})
