"""DDP in virtual time: N ranks computed in turn in one process, each step's exchange costed by the ring model.

``run_ddp_training.py --clock virtual`` (``system.clock: virtual``). DDP keeps every replica
identical, so one model and one optimizer stand for all ranks: each step, every rank's real
gradient is computed on its real shard's batch (the DDP trainer's own loss scaling,
:func:`src.ddp_trainer._scaled_loss`), the gradients are combined exactly as the comm hook combines
them, and one optimizer step follows:

* no compression (the backend's allreduce, or the ring hook): the mean of the ranks' gradients;
* compression (:mod:`src.ddp.comm_hooks`): each rank's buckets compensated by *its* error feedback and
  compressed (:func:`~src.ddp.compressed_exchange.encode_segments`), every rank's payloads decompressed and
  summed in rank order (:func:`~src.ddp.compressed_exchange.accumulate_payloads`), the mean written back
  (:func:`~src.ddp.compressed_exchange.write_average_`): the hook's own code, over DDP's own bucket layout
  (:func:`~src.ddp.hook_state.rebuilt_buckets`). Warm-up steps are the plain mean.

Time (:mod:`src.emulation.cost_model`): the exchange overlaps backward, bucket by bucket, as a real DDP's does.
Each rank's compute (``emulation.compute_s``, ``slowdown``, ``step_delay_s`` per rank) spreads over the model's
layers as a streamed parameter-server step's does (:func:`src.virtual.layers.layer_profile`'s proxy, or
``emulation.layer_split``): the forward, then backward from the last layer to the first. A bucket is ready on a rank
when backward has produced its every gradient, and its exchange starts once every rank has it ready and the bucket
before it is through (one collective at a time, in DDP's bucket order, on the slowest rank's link:
``uplink_mbps``, ``uplink_latency_ms``): :func:`~src.emulation.cost_model.ring_allreduce_s` of its bytes, or, with
compression, its share of ``compress_s`` and :func:`~src.emulation.cost_model.all_gather_s` of its exact payloads.
An emulated straggler's added seconds come after its backward and exchange in a real DDP, so its next step starts
that much later: here they come before its forward. A step ends when the slowest rank's compute and the last
bucket's exchange are through; its communication seconds are what the exchange adds past the compute (exposed).

Outputs as a real DDP run's: ``summary.json`` (``clock: virtual``), the run's ``events.jsonl`` and
TensorBoard under ``log_dir``, ``rank_<k>/events.jsonl``, the final checkpoint. Faults are not
simulated for DDP (the parameter server's are, :mod:`src.virtual.run`): a config with faults is refused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from src.common.checkpoint import final_checkpoint_path, save_checkpoint
from src.common.clock import VirtualClock
from src.compressors.policy import policy_from_config
from src.config import Config, SetupError
from src.ddp.comm_stats import ring_allreduce_bytes
from src.ddp.compressed_exchange import accumulate_payloads, encode_segments, write_average_
from src.ddp.hook_state import CompressionHookState, Piece, rebuilt_buckets
from src.ddp_trainer import _scaled_loss
from src.emulation.cost_model import CostModel, all_gather_s, ring_allreduce_s
from src.emulation.overlap import encode_times, ready_offsets, split_step
from src.metrics import LOG_EVERY_STEPS, MetricsLogger, TimeToTarget, write_summary
from src.trainer import (
    checkpoint_of_run,
    epoch_evaluation_due,
    eval_due,
    evaluate,
    load_splits,
    model_from_config,
    optimizer_from_config,
    samples_due,
)
from src.training.data import make_shards, steps_per_epoch
from src.virtual.calibration import with_measured_figures
from src.virtual.layers import run_layers


class VirtualDDP:
    """One virtual-time DDP job (see the module docstring).

    Raises:
        SetupError: faults configured, or a cost-model figure missing (names the field and the calibration command).
    """

    def __init__(self, config: Config, *, tensorboard: bool = True):
        system, t = config.system, config.training
        _refuse_faults(config)
        self.config = config
        self.cost = CostModel(config, server=False)
        self.clock = VirtualClock()
        self.world = system.num_workers
        self.tensorboard = tensorboard and "tensorboard" in config.metrics.trackers
        self.train_set, self.test_set = load_splits(config)
        self.model = model_from_config(config)
        self.optimizer = optimizer_from_config(config, self.model.parameters())
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.buckets = rebuilt_buckets(self.model, self.train_set.images[:1])
        by_name = dict(self.named)
        self.bucket_params = [[by_name[name] for name in bucket] for bucket in self.buckets]
        self.gradient_bytes = 4 * sum(p.numel() for _, p in self.named)
        self.states: list[CompressionHookState] | None = None
        self.hook_name = "ring" if system.allreduce == "ring" else "allreduce"
        if system.compression_enabled:
            policy = policy_from_config(system)
            names = {id(p): n for n, p in self.model.named_parameters()}
            self.states = [
                CompressionHookState(
                    policy,
                    param_names=names,
                    error_feedback=system.error_feedback,
                    plain_allreduce=system.allreduce,
                    seed=t.seed,
                    overlap=False,
                )
                for _ in range(self.world)
            ]
            self.hook_name = policy.compressor.name
            first = self.states[0]
            self.segments = [[first._segment(self._pieces(bucket))] for bucket in self.bucket_params]
        if self.cost.uplink_schedule:
            raise SetupError(
                "emulation.uplink_schedule: a mid-run link change is modelled in the parameter server's "
                "virtual time only, not in virtual DDP"
            )
        self.layers = run_layers(self.model, self.train_set.images[0], config)
        served = {id(p): index for index, (_, p) in enumerate(self.named)}
        self.bucket_indices = [[served[id(p)] for p in params] for params in self.bucket_params]
        self.bucket_bytes = [4 * sum(p.numel() for p in params) for params in self.bucket_params]
        links = [w.uplink_bps for w in self.cost.workers]
        self.bandwidth_bps = None if any(b is None for b in links) else min(links)
        self.latency_s = max(w.uplink_latency_s for w in self.cost.workers)
        self.bytes_sent_per_rank = 0
        self.exchange_s = 0.0
        self.step = 0

    def _pieces(self, params: list[torch.nn.Parameter]) -> list[Piece]:
        names = {id(p): n for n, p in self.named}
        pieces, offset = [], 0
        for param in params:
            pieces.append(Piece(names[id(param)], offset, param.numel(), param.shape))
            offset += param.numel()
        return pieces

    # ------------------------------------------------------------------------- a step

    def _bucket_gradients(self) -> list[torch.Tensor]:
        """This rank's gradients, one flat tensor per bucket in DDP's order."""
        return [
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            for params in self.bucket_params
        ]

    def _train_step(self, rank_batches: list[list[int]], step_samples: int) -> tuple[float, float, int, list[int]]:
        """One synchronous step of every rank; returns (rank 0's mean loss, its accuracy, samples, rank 0's payload
        bytes per bucket)."""
        step = self.step
        compressing = self.states is not None and step >= self.states[0].policy.warmup_steps
        totals: list[list[torch.Tensor | None]] = [[None] for _ in self.buckets]
        payload_bytes = [0] * len(self.buckets)
        first_loss, first_correct, first_count = 0.0, 0, 0
        for rank, indices in enumerate(rank_batches):
            images, labels = self.train_set.batch(indices)
            self.optimizer.zero_grad(set_to_none=True)
            loss, local_mean, correct = _scaled_loss(self.model(images), labels, self.world, step_samples)
            loss.backward()
            if rank == 0:
                first_loss, first_correct, first_count = local_mean, correct, len(labels)
            for index, buffer in enumerate(self._bucket_gradients()):
                if compressing:
                    state = self.states[rank]
                    payloads, compensated = encode_segments(state, buffer, self.segments[index], step, rank)
                    accumulate_payloads(
                        state,
                        totals[index],
                        b"".join(payloads),
                        self.segments[index],
                        [len(p) for p in payloads],
                        buffer.device,
                        compensated=compensated,
                    )
                    payload_bytes[index] += sum(len(p) for p in payloads) if rank == 0 else 0
                else:
                    totals[index][0] = buffer if totals[index][0] is None else totals[index][0].add_(buffer)
        for index, params in enumerate(self.bucket_params):  # the mean, back into the gradients
            mean = (
                totals[index][0].div_(self.world)
                if not compressing
                else write_average_(torch.empty_like(totals[index][0]), self.segments[index], totals[index], self.world)
            )
            offset = 0
            for param in params:
                param.grad = mean[offset : offset + param.numel()].view_as(param).clone()
                offset += param.numel()
        self.optimizer.step()
        if self.states is not None:
            for state in self.states:
                state.step += 1
        self.step += 1
        return first_loss, first_correct / max(first_count, 1), sum(len(b) for b in rank_batches), payload_bytes

    def _step_seconds(
        self, rank_batches: list[list[int]], payload_bytes: list[int], compressing: bool
    ) -> tuple[float, float]:
        """(the step's virtual seconds, its exposed exchange's): each bucket's exchange once every rank's backward
        produced it and the bucket before it is through, the step's end the slowest rank's compute or the last
        exchange's (see the module docstring)."""
        ready = [0.0] * len(self.buckets)
        slowest = 0.0
        for rank, batch in enumerate(rank_batches):
            step_s, extra_s = self.cost.step_s(rank, len(batch))
            split_s = split_step(step_s - extra_s, self.layers.weights)
            offsets = ready_offsets([b for _, b in split_s], self.layers.layer_of)
            backward_starts = extra_s + sum(f for f, _ in split_s)  # its straggling, then its forward
            for index, params in enumerate(self.bucket_indices):
                ready[index] = max(ready[index], backward_starts + max(offsets[i] for i in params))
            slowest = max(slowest, step_s)
        if compressing:
            seconds = [
                self.cost.compress_s * size / self.gradient_bytes
                + all_gather_s(self.world, [sent] * self.world, self.bandwidth_bps, self.latency_s)
                for size, sent in zip(self.bucket_bytes, payload_bytes)
            ]
            self.bytes_sent_per_rank += (self.world - 1) * sum(payload_bytes)
        else:
            seconds = [
                ring_allreduce_s(self.world, size, self.bandwidth_bps, self.latency_s) for size in self.bucket_bytes
            ]
            self.bytes_sent_per_rank += ring_allreduce_bytes(self.world, self.gradient_bytes)
        exchanged = encode_times(ready, seconds)[-1] if seconds else 0.0  # one collective after another
        step = max(slowest, exchanged)
        return step, step - slowest

    # ------------------------------------------------------------------------- the run

    def run(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        t, system = self.config.training, self.config.system
        log_dir, checkpoint_dir = Path(system.log_dir), Path(system.checkpoint_dir)
        summary_path = Path(summary_json) if summary_json else log_dir / "summary.json"
        started = time.perf_counter()
        target = TimeToTarget(t.target_accuracy)
        run_log = MetricsLogger(log_dir, tensorboard=self.tensorboard, clock=self.clock.time)
        rank_logs = [
            MetricsLogger(log_dir / f"rank_{r}", tensorboard=False, rank=r, clock=self.clock.time)
            for r in range(self.world)
        ]
        try:
            run_log.event(
                "run_start",
                architecture="ddp",
                config=self.config.to_dict(),
                world_size=self.world,
                backend="virtual",
                comm_hook=self.hook_name,
                clock="virtual",
            )
            num_train = len(self.train_set)
            per_step = t.batch_size * self.world
            num_steps = steps_per_epoch(num_train, self.world, t.batch_size)
            samples = 0
            final_loss = final_accuracy = float("nan")
            for epoch in range(t.num_epochs):
                shards = [
                    list(shard.batches(t.batch_size)) for shard in make_shards(num_train, self.world, epoch, t.seed)
                ]
                for index in range(num_steps):
                    rank_batches = [shard[index] if index < len(shard) else [] for shard in shards]
                    step_samples = min(per_step, num_train - index * per_step)
                    compressing = self.states is not None and self.step >= self.states[0].policy.warmup_steps
                    loss, accuracy, step_count, payload_bytes = self._train_step(rank_batches, step_samples)
                    seconds, exchange = self._step_seconds(rank_batches, payload_bytes, compressing)
                    self.clock.advance_to(self.clock.now + seconds)
                    self.exchange_s += exchange
                    samples += step_count
                    if self.step % LOG_EVERY_STEPS == 0 or index + 1 == num_steps:
                        rank_logs[0].scalars(
                            "train",
                            self.step,
                            {
                                "loss": loss,
                                "accuracy": accuracy,
                                "step_time_s": seconds,
                                "communication_time_s": exchange,
                                "samples_processed": samples,
                            },
                            epoch=epoch,
                        )
                    epoch_end = index + 1 == num_steps and epoch_evaluation_due(t, epoch)
                    if eval_due(self.step, t.eval_interval, epoch_end=epoch_end) or samples_due(
                        samples - step_count, samples, t.eval_every_samples
                    ):
                        final_loss, final_accuracy = evaluate(self.model, self.test_set, batch_size=t.eval_batch_size)
                        run_log.scalars(
                            "eval",
                            self.step,
                            {"test_loss": final_loss, "test_accuracy": final_accuracy},
                            epoch=epoch + (index + 1 == num_steps),
                            samples=samples,
                            elapsed_s=self.clock.now,
                        )
                        target.observe(final_accuracy, self.clock.now, self.step)
            checkpoint = checkpoint_of_run(
                self.config, self.model, self.optimizer, epoch=t.num_epochs, step=self.step, extra=self._hook_extra()
            )
            checkpoint_path = save_checkpoint(final_checkpoint_path(checkpoint_dir, "ddp"), checkpoint)
            summary = self._summary(
                final_loss, final_accuracy, samples, str(checkpoint_path), target, time.perf_counter() - started
            )
            run_log.event("run_end", **summary)
            write_summary(summary_path, summary)
            run_log.finish(summary, artifacts=[summary_path, checkpoint_path])
            return summary
        finally:
            run_log.close()
            for log in rank_logs:
                log.close()

    def _hook_extra(self) -> dict[str, Any]:
        ranks = [state.state_dict() for state in self.states] if self.states is not None else [{}] * self.world
        return {
            "comm_hook": {"name": self.hook_name, "world_size": self.world, "ranks": ranks},
            "epoch_step": 0,
            "world_size": self.world,
        }

    def _summary(
        self,
        final_loss: float,
        final_accuracy: float,
        samples: int,
        checkpoint_path: str,
        target: TimeToTarget,
        wall_s: float,
    ) -> dict[str, Any]:
        t, system = self.config.training, self.config.system
        compression = system.compression_type if system.compression_enabled else "none"
        train_time = self.clock.now
        total = self.bytes_sent_per_rank * self.world
        return {
            "architecture": "ddp",
            "dataset": t.dataset,
            "num_workers": self.world,
            "world_size": self.world,
            "backend": "virtual",
            "allreduce": system.allreduce,
            "comm_hook": self.hook_name,
            "compression": compression,
            "compression_ratio": system.compression_ratio if compression == "topk" else None,
            "quantization_bits": system.quantization_bits if compression == "quantization" else None,
            "error_feedback": bool(system.compression_enabled and system.error_feedback),
            "epochs": t.num_epochs,
            "final_accuracy": final_accuracy,
            "final_loss": final_loss,
            "checkpoint_path": checkpoint_path,
            "steps": self.step,
            "steps_this_run": self.step,
            "restarts": 0,
            "resumed_from": None,
            "clock": "virtual",
            "training_clock": "the slowest rank's steps, exchanges overlapping backward (virtual time)",
            **target.fields(),
            "total_time_s": train_time,
            "train_time_s": train_time,
            "throughput_samples_per_s": samples / train_time if train_time > 0 else 0.0,
            "samples_processed": samples,
            "bytes_sent": total,
            "bytes_received": total,
            "bytes_sent_measured": total if self.states is not None else 0,
            "bytes_sent_estimated": 0 if self.states is not None else total,
            "bytes_accounting": "measured" if self.states is not None else "estimated",
            "bytes_sent_per_rank_per_step": self.bytes_sent_per_rank / self.step if self.step else 0.0,
            "communication_time_s": self.exchange_s,
            "cost_model": self.cost.describe(),
            "wall_time_s": wall_s,
            "wall_time_fields": ["wall_time_s"],
        }


def run_virtual_ddp(
    config: Config, *, summary_json: str | Path | None = None, tensorboard: bool = True
) -> dict[str, Any]:
    """Run a DDP job in virtual time (see the module docstring); returns the run summary. The figures the config
    lacks are measured on this machine first, and said on stderr (as :func:`src.virtual.run.run_virtual` does)."""
    _refuse_faults(config)  # before any measuring
    config, measured = with_measured_figures(config, server=False)
    run = VirtualDDP(config, tensorboard=tensorboard)
    run.cost.measured_here = measured
    return run.run(summary_json)


def _refuse_faults(config: Config) -> None:
    if config.system.inject_faults:
        raise SetupError(
            "system.inject_faults: faults are simulated in virtual time for the parameter server only; "
            "run DDP faults on the real clock"
        )
