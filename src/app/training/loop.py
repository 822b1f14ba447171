"""The training loop (`trainer=trainval`): one function, read top to bottom."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from app import dist, progress
from app.checkpoint.manager import CheckpointManager
from app.checkpoint.rng import RandomStates
from app.checkpoint.sharded import OptimizerState, Weights
from app.config import AppConfig
from app.data import DataModule
from app.errors import UserError
from app.reporting.curves import draw_curves
from app.reporting.loggers import MetricLogger
from app.rundir.name import resume_hint
from app.schedulers import respread
from app.training.build import (
    ResumableSampler,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    build_train_loader,
    build_val_loader,
)
from app.training.ema import ModelEMA
from app.training.hooks import Callbacks, Run
from app.training.runtime import seed_everything
from app.training.sharding import checkpoint_activations, settle_buckets, shard
from app.training.state import (
    LoopState,
    finished,
    improved,
    last_step,
    should_checkpoint,
    should_log,
    should_validate,
)
from app.training.step import FiniteLosses, TrainStep
from app.training.stop import StopRequest
from app.training.telemetry import Telemetry, flops_per_batch, peak_flops
from app.training.validate import validate

log = logging.getLogger(__name__)


@dataclass
class Training:
    """What a run trains with, built in the one order that fixes its random draws: the
    replay of a run (app.training.replay) builds the same, so its steps are the run's."""

    data: DataModule
    model: nn.Module  # unwrapped: validation and the checkpoints use it
    ema: ModelEMA | None
    train_model: nn.Module  # what the step runs: compiled, DDP's wrapper, or the model
    optimizer: torch.optim.Optimizer
    train_loader: DataLoader
    sampler: ResumableSampler
    steps_per_epoch: int
    global_batch: int
    state: LoopState  # shared by the loop, the callbacks' `run` and the checkpoints
    scheduler: Any
    train_step: TrainStep
    flops: int | None  # of one micro-batch's forward and backward (trainer.telemetry)

    def parts(self, callbacks: Callbacks | None = None) -> dict[str, Any]:
        """What a checkpoint holds, by name (loaded in this order: the random states last)."""
        return {"model": Weights(self.model),
                "optimizer": OptimizerState(self.model, self.optimizer),
                "scheduler": self.scheduler, "train_step": self.train_step, "loop": self.state,
                **({"callbacks": callbacks} if callbacks is not None else {}),
                "data": self.data, "rng": RandomStates()}


def build_training(cfg: AppConfig, device: torch.device) -> Training:
    t = cfg.trainer
    world_size, accumulate = dist.world_size(), t.accumulate_grad_batches
    seed_everything(cfg.seed)  # the same initial weights on every rank
    data = build_data(cfg)
    model = _model_on(device, cfg, data)
    global_batch = data.batch_size * world_size * accumulate
    # Counted before DDP or FSDP wrap it (on meta tensors: nothing of the model's changes).
    flops = flops_per_batch(model, data.input_shape, data.batch_size, data.num_classes) \
        if t.telemetry else None
    ema = ModelEMA(model, t.ema_decay, t.ema_warmup_steps) if t.ema else None
    checkpoint_activations(model, t.activation_checkpointing)  # (not the EMA's: no backward)
    train_model = _wrapped_for_training(model, ema, cfg, device, data)
    # After the wrapping: FSDP replaces the parameters with their shards.
    optimizer = build_optimizer(cfg, model, global_batch=global_batch)
    torch.manual_seed(cfg.seed + dist.rank())  # dropout differs between ranks, repeatably
    train_loader, sampler = build_train_loader(data, cfg.seed)
    steps_per_epoch = len(train_loader) // accumulate  # a partial group at the end is dropped
    if steps_per_epoch == 0:
        raise UserError(
            f"data.batch_size={data.batch_size} x trainer.accumulate_grad_batches={accumulate} "
            f"is larger than the {len(sampler)} training samples of a process: lower them")
    state = LoopState(global_batch=global_batch, steps_per_epoch=steps_per_epoch)
    scheduler = build_scheduler(cfg, optimizer, total_steps=last_step(state, t, steps_per_epoch))
    train_step = TrainStep(model, train_model, optimizer, scheduler, device, cfg.precision,
                           t.grad_clip_norm, ema, skip_nonfinite=t.skip_nonfinite,
                           broadcast_buffers=cfg.distributed.broadcast_buffers)
    return Training(data, model, ema, train_model, optimizer, train_loader, sampler,
                    steps_per_epoch, global_batch, state, scheduler, train_step, flops)


def train(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    """Train with periodic validation and checkpoints; returns the best monitored value."""
    t = cfg.trainer
    metric = t.monitor.partition("/")[2]  # (a config.Monitor: checked at compose time)
    world_size, accumulate = dist.world_size(), t.accumulate_grad_batches
    built = build_training(cfg, device)
    data, model, ema, state = built.data, built.model, built.ema, built.state
    optimizer, scheduler, train_step = built.optimizer, built.scheduler, built.train_step
    train_loader, sampler = built.train_loader, built.sampler
    steps_per_epoch, global_batch = built.steps_per_epoch, built.global_batch
    val_loader = build_val_loader(data)
    total_steps = last_step(state, t, steps_per_epoch)
    losses = FiniteLosses()
    telemetry = train_step.telemetry = Telemetry(
        run_dir, device, global_batch, built.flops and built.flops * accumulate,
        peak_flops(device, t.peak_flops)) if t.telemetry else None
    if telemetry is not None:
        telemetry.watch_gradients(model)
    eval_model = ema.module if ema is not None else model  # EMA weights validate when enabled
    callbacks = Callbacks.build(cfg)
    run = Run(cfg, run_dir, device, model, eval_model, optimizer, data,
              global_batch=global_batch, total_steps=total_steps, state=state)
    progress.follow(run)  # the stall watchdog names run.step

    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg, built.parts(callbacks),
                                    changed_only_by_step=train_step.changed_only_by_step)
    train_step.before_update = checkpoints.hold_until_copied  # (the background copy first)
    checkpoints.restore()  # resume=, or the weights of ckpt=, or nothing
    # A resume counts the steps left from where the run is: on another number of ranks (or
    # batch size, or accumulation) an epoch has another number of steps, and the schedule,
    # made for the saved run's, is spread over this run's.
    saved = state.rebatch(global_batch, steps_per_epoch)
    total_steps = run.total_steps = last_step(state, t, steps_per_epoch)
    if saved is not None:
        respread(scheduler, state.step, last_step(saved, t, saved.steps_per_epoch), total_steps)
    report = _Report(cfg, run_dir, run, callbacks, resumed=checkpoints.resumed_from is not None,
                     trackers=checkpoints.trackers, telemetry=telemetry)
    if checkpoints.resumed_from is not None and finished(state, t):  # a re-run sweep job
        log.info("already finished at step %d%s: nothing to train", state.step,
                 f" ({state.stopped_early})" if state.stopped_early else "")
    else:
        # What the epoch's whole steps leave: each rank's partial batch (drop_last) or group of
        # micro-batches; others each epoch, as the order is shuffled.
        left_out = len(data.train) - steps_per_epoch * global_batch
        log.info("training %s on %s x %d: %d steps/epoch, %d steps, %d train / %d val samples%s",
                 cfg.model["_target_"], device.type, world_size, steps_per_epoch, total_steps,
                 len(data.train), len(data.val),
                 f", {left_out} train samples left out each epoch (a partial batch; drop_last)"
                 if left_out > 0 else "")
    model.train()
    with report, StopRequest() as stop, callbacks.running(run), \
            telemetry.memory_snapshot_on_oom() if telemetry else contextlib.nullcontext():
        if telemetry is not None:
            telemetry.begin(state.step)
        while not finished(state, t):
            micro_batches = epoch_batches(cfg, state, data, train_loader, sampler)
            for _ in range(steps_per_epoch - state.batch_in_epoch):
                if telemetry is not None:
                    telemetry.mark("start")
                batch = [next(micro_batches) for _ in range(accumulate)]
                if telemetry is not None:
                    telemetry.mark("data")
                loss = train_step(batch)
                state.advance(steps_per_epoch)
                if not t.skip_nonfinite:
                    losses.check(loss, state.step)  # raises for earlier steps' non-finite loss
                for hook in callbacks.on_step_end:
                    hook(run, state.step, loss)
                done = finished(state, t)
                report.step_done()
                if should_log(state, t, done):
                    losses.flush()  # (the loss is read back here anyway)
                    report.train(loss, scheduler.get_last_lr()[0])

                val_metrics, is_best = None, False
                if should_validate(state, t, done):
                    losses.flush()  # never a validation of weights a non-finite loss made
                    val_metrics, _ = validate(eval_model, val_loader, device)
                    is_best = improved(val_metrics[metric], state.best, t.monitor_mode)
                    if is_best:
                        state.best = val_metrics[metric]
                    report.validation(val_metrics, is_best)
                    if callbacks:
                        state.stopped_early = callbacks.validation_end(
                            run, state.step, {f"val/{k}": v for k, v in val_metrics.items()})
                        if state.stopped_early is not None:
                            log.info("step %d: %s", state.step, state.stopped_early)
                            done = True

                stopping = stop.should_stop()
                if done or stopping or should_checkpoint(state, t, is_best):
                    losses.flush()  # never a checkpoint of weights a non-finite loss made
                    if telemetry is not None:
                        telemetry.mark("checkpoint")
                    checkpoints.save(val_metrics, is_best, last=done or stopping)
                    if telemetry is not None:
                        telemetry.mark("checkpointed")
                if telemetry is not None:
                    telemetry.step_done()
                if stopping:
                    stopped = stop.stopped(state.step, resume_hint(run_dir))
                    report.end_trackers(stopped)  # (a requeue ends every process of the job)
                    stop.requeue()  # when a job system asked for it (submitit on SLURM)
                    raise stopped
                if done:
                    break
    report.close()
    if train_step.skipped:
        log.warning("%d step(s) skipped for a non-finite loss (trainer.skip_nonfinite=true)",
                    train_step.skipped)
    checkpoints.log_totals()
    log.info("done: step %d, best %s %s", state.step, t.monitor,
             "none" if state.best is None else f"{state.best:.4f}")
    return state.best


def _model_on(device: torch.device, cfg: AppConfig, data: DataModule) -> nn.Module:
    """The model to train, in the precision asked for, on `device`: unwrapped (no `module.` or
    `_orig_mod.` prefixes), as validation and the checkpoints use it."""
    model = build_model(cfg, data)
    if cfg.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if cfg.distributed.sync_batchnorm and dist.world_size() > 1:
        if device.type in ("cpu", "mps"):
            raise UserError("distributed.sync_batchnorm=true needs GPU (or XPU) devices: "
                            "PyTorch's SyncBatchNorm has no CPU kernel")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(device)


def _wrapped_for_training(model: nn.Module, ema: ModelEMA | None, cfg: AppConfig,
                          device: torch.device, data: DataModule) -> nn.Module:
    """What the train step runs, compiled when asked; with several ranks, the DDP wrapper
    (which also broadcasts rank 0's weights), or under fsdp the model itself, sharded in
    place, and the EMA's copy alike (app.training.sharding)."""
    d = cfg.distributed
    train_model: nn.Module = model
    if dist.world_size() > 1 and d.strategy == "fsdp":
        for module in (model, *([ema.module] if ema is not None else [])):
            shard(module, device, d.fsdp.wrap, cfg.precision, d.fsdp.reshard_after_forward)
    elif dist.world_size() > 1:
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
            bucket_cap_mb=d.bucket_cap_mb, **dist.ddp_buffer_sync(d.broadcast_buffers))
        if not d.find_unused_parameters:  # (then DDP never regroups its buckets)
            settle_buckets(train_model, data.train, device, cfg.precision)
    return torch.compile(train_model) if cfg.compile else train_model


def epoch_batches(cfg: AppConfig, state: LoopState, data: DataModule, loader: DataLoader,
                   sampler: ResumableSampler) -> Iterator:
    """The micro-batches of the epoch `state` is in, from where it stands in it. Each epoch's
    order comes from (seed, epoch) alone, so a resumed run sees the same batches; skipping on
    the sampler never loads the batches already trained on."""
    epoch, skip = state.epoch, state.batch_in_epoch * cfg.trainer.accumulate_grad_batches
    sampler.set_epoch(epoch, skip=skip * data.batch_size)
    loader.generator.manual_seed((cfg.seed * 100_003 + epoch) * 1009 + dist.rank())
    data.set_epoch(epoch, cfg.seed)
    return iter(loader)


class _Report:
    """Where the loop's metrics go: the callbacks' on_log, the metric files (rank 0), and the
    progress bar or, without one, a log line."""

    def __init__(self, cfg: AppConfig, run_dir: Path, run: Run, callbacks: Callbacks,
                 resumed: bool, trackers: dict[str, str], telemetry: Telemetry | None) -> None:
        self.run, self.callbacks, self.run_dir = run, callbacks, run_dir
        self.telemetry = telemetry
        self.ended = False  # the trackers ended early (a stop, an error)
        self.logger = MetricLogger(run_dir, cfg.logger, run.step if resumed else None,
                                   trackers) if dist.is_main() else None
        if self.logger is not None:
            self.logger.log_config(cfg)
        show = cfg.trainer.progress_bar
        show = show if show is not None else sys.stderr.isatty()
        self.bar = _progress_bar(run.total_steps, run.step) if show and dist.is_main() else None

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def train(self, loss: torch.Tensor, lr: float) -> None:
        """Every rank calls it (the loss is averaged over them)."""
        step, epoch = self.run.step, self.run.epoch
        # .item() waits for the device: only on logging steps. With NCCL that is where the
        # host waits for a slow rank (app.progress.waiting).
        with progress.waiting():
            loss_value = dist.all_reduce_mean(loss.detach()).item()
        metrics = {"loss": loss_value, "lr": lr}
        if self.telemetry is not None:
            metrics.update(self.telemetry.read(step))
        self.callbacks.log(self.run, step, metrics)
        if self.logger is not None:
            self.logger.log(step, epoch, "train", metrics)
        if self.bar is not None:
            speed = {} if self.telemetry is None else {
                "ms/step": f"{metrics['time/step_s'] * 1e3:.1f}",
                "wait": f"{metrics['time/wait_s'] / max(metrics['time/step_s'], 1e-12):.0%}"}
            self.bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", **speed)
        else:
            log.info("step %d/%d epoch %d: loss %.4f lr %.3e%s",
                     step, self.run.total_steps, epoch, loss_value, lr,
                     f" | {self.telemetry.line(metrics)}" if self.telemetry else "")

    def validation(self, metrics: dict[str, float], is_best: bool) -> None:
        step, epoch = self.run.step, self.run.epoch
        if self.logger is not None:
            self.logger.log(step, epoch, "val", metrics)
        log.info("step %d epoch %d: val loss %.4f acc %.4f%s", step, epoch,
                 metrics["loss"], metrics["acc"], " (best)" if is_best else "")

    def __enter__(self) -> _Report:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        """A run that stops by an error or a signal ends its tracker runs too, as failed or
        killed: what they buffer is written (W&B's offline file would stay empty), and a
        resume continues them."""
        if error is not None:
            self.end_trackers(error)
        if self.telemetry is not None:  # (a run that stops has its figures too)
            self.telemetry.close()

    def end_trackers(self, error: BaseException) -> None:
        if self.logger is None or self.ended:
            return
        self.ended = True
        try:
            self.logger.close(error)
        except Exception as e:  # (the run's own error is the one to report)
            log.warning("the trackers did not close: %s", e)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:
            self.logger.close()
            draw_curves(self.run_dir)


def _progress_bar(total_steps: int, initial: int) -> Any:
    import os

    from tqdm import tqdm

    # tqdm hides a bar below the terminal's last row, so a terminal that reports no size
    # (0 x 0, as some consoles and containers do) would show no progress: a fixed size.
    try:
        sized = 0 not in os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):  # not a terminal (progress_bar=true into a file)
        sized = True  # tqdm's own defaults
    return tqdm(total=total_steps, initial=initial, unit="step", dynamic_ncols=sized,
                ncols=None if sized else 80, nrows=None if sized else 24)
