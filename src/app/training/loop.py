"""The training loop (`trainer=trainval`): one function, read top to bottom."""

from __future__ import annotations

import logging
import math
import signal
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from app import dist
from app.callbacks import Callbacks, Run
from app.checkpoint.manager import CheckpointManager
from app.config import AppConfig, AppError, UserError
from app.launch import watchdog
from app.modes.evaluate import evaluate
from app.reporting.curves import draw_curves
from app.reporting.loggers import MetricLogger
from app.training.build import (
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    build_train_loader,
    build_val_loader,
)
from app.training.ema import ModelEMA
from app.training.runtime import seed_everything
from app.training.state import (
    LoopState,
    finished,
    improved,
    should_checkpoint,
    should_log,
    should_validate,
)
from app.training.step import FiniteLosses, TrainStep
from app.training.stop import StopRequest

log = logging.getLogger(__name__)


class Interrupted(AppError):
    """The run was asked to stop (SIGINT/SIGTERM); a checkpoint of the last step was saved."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process ended by signum


def train(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    """Train with periodic validation and checkpoints; returns the best monitored value."""
    t = cfg.trainer
    metric = t.monitor.partition("/")[2]  # (a config.Monitor: checked at compose time)
    rank, world_size = dist.rank(), dist.world_size()
    accumulate = t.accumulate_grad_batches
    seed_everything(cfg.seed)  # the same initial weights on every rank
    data = build_data(cfg)
    model = build_model(cfg, data)
    if cfg.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if cfg.distributed.sync_batchnorm and world_size > 1:
        if device.type in ("cpu", "mps"):
            raise UserError("distributed.sync_batchnorm=true needs GPU (or XPU) devices: "
                            "PyTorch's SyncBatchNorm has no CPU kernel")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    optimizer = build_optimizer(cfg, model, global_batch=data.batch_size * world_size * accumulate)
    ema = ModelEMA(model, t.ema_decay, t.ema_warmup_steps) if t.ema else None
    # The model stays unwrapped for validation and checkpoints (no `module.` or `_orig_mod.`
    # prefixes); the DDP wrapper (which also broadcasts rank 0's weights) and the compiled
    # module only train.
    d = cfg.distributed
    train_model: nn.Module = model if world_size == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=d.find_unused_parameters, static_graph=d.static_graph,
        bucket_cap_mb=d.bucket_cap_mb, **dist.ddp_buffer_sync(d.broadcast_buffers))
    if cfg.compile:
        train_model = torch.compile(train_model)
    torch.manual_seed(cfg.seed + rank)  # dropout differs between ranks, repeatably
    train_loader, sampler = build_train_loader(data, cfg.seed)
    val_loader = build_val_loader(data)
    steps_per_epoch = len(train_loader) // accumulate  # a partial group at the end is dropped
    if steps_per_epoch == 0:
        raise UserError(
            f"data.batch_size={data.batch_size} x trainer.accumulate_grad_batches={accumulate} "
            f"is larger than the {len(sampler)} training samples of a process: lower them"
        )
    total_steps = min(
        t.max_steps or math.inf, (t.max_epochs or math.inf) * steps_per_epoch)
    scheduler = build_scheduler(cfg, optimizer, total_steps=int(total_steps))
    train_step = TrainStep(model, train_model, optimizer, scheduler, device, cfg.precision,
                           t.grad_clip_norm, ema, skip_nonfinite=t.skip_nonfinite)
    losses = FiniteLosses()
    eval_model = ema.module if ema is not None else model  # EMA weights validate when enabled
    callbacks = Callbacks.build(cfg)
    run = Run(cfg, run_dir, device, model, eval_model, optimizer, data,
              global_batch=data.batch_size * world_size * accumulate, total_steps=int(total_steps))
    watchdog.follow(run)  # the stall watchdog names run.step

    state = LoopState()
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg, train_step, state, callbacks)
    checkpoints.restore()
    if checkpoints.resumed_from is not None and finished(state, t):  # a re-run sweep job
        log.info("already finished at step %d%s: nothing to train", state.step,
                 f" ({state.stopped_early})" if state.stopped_early else "")

    logger = MetricLogger(run_dir, cfg.logger, state.step if checkpoints.resumed_from else None) \
        if dist.is_main() else None
    if logger is not None:
        logger.log_text("config", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    show_bar = t.progress_bar if t.progress_bar is not None else sys.stderr.isatty()
    bar = None
    if show_bar and dist.is_main():
        import os

        from tqdm import tqdm

        # tqdm hides a bar below the terminal's last row, so a terminal that reports no size
        # (0 x 0, as some consoles and containers do) would show no progress: a fixed size.
        try:
            sized = 0 not in os.get_terminal_size(sys.stderr.fileno())
        except (OSError, ValueError):  # not a terminal (progress_bar=true into a file)
            sized = True  # tqdm's own defaults
        bar = tqdm(total=int(total_steps), initial=state.step, unit="step", dynamic_ncols=sized,
                   ncols=None if sized else 80, nrows=None if sized else 24)

    log.info(
        "training %s on %s x %d: %d steps/epoch, %d steps, %d train / %d val samples",
        cfg.model["_target_"], device.type, world_size, steps_per_epoch, total_steps,
        len(data.train), len(data.val),
    )
    model.train()
    run.step, run.epoch = state.step, state.epoch
    with StopRequest() as stop, callbacks.running(run):
        while not finished(state, t):
            # Each epoch's order comes from (seed, epoch) alone, so a resumed run sees the same
            # batches; skipping on the sampler never loads the batches already trained on.
            epoch = state.epoch
            sampler.set_epoch(epoch, skip=state.batch_in_epoch * accumulate * data.batch_size)
            train_loader.generator.manual_seed((cfg.seed * 100_003 + epoch) * 1009 + rank)
            data.set_epoch(epoch, cfg.seed)
            micro_batches = iter(train_loader)
            for _ in range(steps_per_epoch - state.batch_in_epoch):
                loss = train_step([next(micro_batches) for _ in range(accumulate)])
                state.advance(steps_per_epoch)
                step, epoch = state.step, state.epoch
                if not t.skip_nonfinite:
                    losses.check(loss, step)  # raises for an earlier step's non-finite loss
                run.step, run.epoch = step, epoch
                for hook in callbacks.on_step_end:
                    hook(run, step, loss)
                done = finished(state, t)

                if bar is not None:
                    bar.update()
                if should_log(state, t, done):
                    # .item() waits for the device: only on logging steps. With NCCL that is
                    # where the host waits for a slow rank (app.launch.watchdog.waiting).
                    with watchdog.waiting():
                        loss_value = dist.all_reduce_mean(loss.detach()).item()
                    lr = scheduler.get_last_lr()[0]
                    train_metrics = {"loss": loss_value, "lr": lr}
                    callbacks.log(run, step, train_metrics)
                    if logger is not None:
                        logger.log(step, epoch, "train", train_metrics)
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                    else:
                        log.info("step %d/%d epoch %d: loss %.4f lr %.3e",
                                 step, total_steps, epoch, loss_value, lr)

                val_metrics, is_best = None, False
                if should_validate(state, t, done):
                    val_metrics, _ = evaluate(eval_model, val_loader, device)
                    if logger is not None:
                        logger.log(step, epoch, "val", val_metrics)
                    is_best = improved(val_metrics[metric], state.best, t.monitor_mode)
                    if is_best:
                        state.best = val_metrics[metric]
                    log.info("step %d epoch %d: val loss %.4f acc %.4f%s", step, epoch,
                             val_metrics["loss"], val_metrics["acc"], " (best)" if is_best else "")
                    if callbacks:
                        state.stopped_early = callbacks.validation_end(
                            run, step, {f"val/{k}": v for k, v in val_metrics.items()})
                        if state.stopped_early is not None:
                            log.info("step %d: %s", step, state.stopped_early)
                            done = True

                stopping = stop.should_stop()
                if done or stopping or should_checkpoint(state, t, is_best):
                    with watchdog.waiting():  # (a wait for the device, as above)
                        losses.flush()  # never a checkpoint of weights a non-finite loss made
                    checkpoints.save(val_metrics, is_best, last=done or stopping)
                if stopping:
                    stop.requeue()  # when a job system asked for it (submitit on SLURM)
                    raise Interrupted(
                        f"stopped by signal {signal.Signals(stop.signal).name} at step {step}; "
                        f"checkpoint saved: run again with hydra.run.dir={run_dir} to resume",
                        stop.signal)
                if done:
                    break
    if bar is not None:
        bar.close()
    if train_step.skipped:
        log.warning("%d step(s) skipped for a non-finite loss (trainer.skip_nonfinite=true)",
                    train_step.skipped)
    checkpoints.log_totals()
    if logger is not None:
        logger.close()
        draw_curves(run_dir)
    log.info("done: step %d, best %s %s", state.step, t.monitor, state.best)
    return state.best
