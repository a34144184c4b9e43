"""Evaluation in a DDP run: each rank scores its slice ``r::N`` of the test split and the sums are all-reduced.

So every rank knows the accuracy, and every rank feeds the time to target and (with adaptive
compression) the controller alike. Evaluation runs with the training clock stopped.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from src.ddp.control import RankControl
from src.ddp.rank import RankContext, all_reduce_floats
from src.metrics import MetricsLogger, TimeToTarget
from src.telemetry import tracing
from src.trainer import TrainingClock, evaluate, report_target
from src.training.data import TensorDataset


class RankEvaluation:
    """Scores ``test_set`` across the group: this rank its own slice, then the sums all-reduced (collective).

    Args:
        test_set: the whole test split (every rank holds it; each scores ``r::N``).
        context: this rank's place.
        batch_size: ``training.eval_batch_size``.
    """

    def __init__(self, test_set: TensorDataset, context: RankContext, batch_size: int):
        rank, world = context.rank, context.world_size
        self.test_part = TensorDataset(
            test_set.info, test_set.images[rank::world].contiguous(), test_set.labels[rank::world].contiguous()
        )
        self.ctx = context
        self.batch_size = batch_size

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(test loss, test accuracy) over the whole test split."""
        count = len(self.test_part)
        loss, accuracy = (
            evaluate(model, self.test_part, batch_size=self.batch_size, device=self.ctx.device) if count else (0.0, 0.0)
        )
        loss_sum, correct, total = all_reduce_floats(self.ctx, [loss * count, round(accuracy * count), count])
        return loss_sum / max(total, 1), correct / max(total, 1)

    def evaluate_and_log(
        self,
        model: nn.Module,
        step: int,
        run_log: MetricsLogger | None,
        epoch: int,
        clock: TrainingClock,
        target: TimeToTarget,
        control: RankControl | None,
    ) -> tuple[float, float]:
        """Evaluate with the clock stopped; rank 0 logs it; every rank feeds ``target`` and ``control``."""
        with clock.paused(), tracing.span("evaluate", step=step):
            loss, accuracy = self.evaluate(model)
            (seconds,) = all_reduce_floats(self.ctx, [clock.seconds], op=dist.ReduceOp.MAX)  # the slowest rank's clock
            event = None
            if run_log is not None:
                event = run_log.scalars("eval", step, {"test_loss": loss, "test_accuracy": accuracy}, epoch=epoch)
                report_target(target, accuracy, seconds, step)
            else:
                target.observe(accuracy, seconds, step)
            if control is not None:
                decision = control.decide(event, self.ctx.collective_device)  # collective: rank 0's, broadcast
                if decision is not None and run_log is not None:
                    run_log.event("controller", **{k: v for k, v in decision.items() if k != "kind"})
        return loss, accuracy
