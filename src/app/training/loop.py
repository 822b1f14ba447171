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
from app.checkpoint import io as checkpoint
from app.checkpoint.writer import CheckpointWriter
from app.config import AppConfig, AppError, MonitorMode, UserError
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
from app.training.runtime import rng_state, seed_everything, set_rng_state
from app.training.step import FiniteLosses, TrainStep
from app.training.stop import StopRequest

log = logging.getLogger(__name__)


class Interrupted(AppError):
    """The run was asked to stop (SIGINT/SIGTERM); a checkpoint of the last step was saved."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process ended by signum


def _every(n: int | None, count: int) -> bool:
    return n is not None and count % n == 0


def _improved(value: float, best: float | None, mode: MonitorMode) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value > best if mode == MonitorMode.max else value < best


def _changed_only_by_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                          ema: ModelEMA | None) -> list[torch.Tensor]:
    """The tensors that nothing but the optimizer step (and the EMA update after it) changes:
    the weights, the optimizer's state, the EMA weights. Not buffers: a forward changes them."""
    tensors = list(model.parameters())
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    if ema is not None:
        tensors += list(ema.module.state_dict().values())
    return tensors


def train(cfg: AppConfig, run_dir: Path, device: torch.device) -> float | None:
    """Train with periodic validation and checkpoints; returns the best monitored value."""
    t = cfg.trainer
    split, _, metric = t.monitor.partition("/")
    if split != "val" or metric not in ("loss", "acc"):
        raise UserError(f"trainer.monitor={t.monitor}: expected val/acc or val/loss")
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
    ema = ModelEMA(model, t.ema_decay, t.ema_warmup_steps) if cfg.ema else None
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
    # The checkpoint writer copies weights, optimizer state and EMA while the next forward and
    # backward run; the update that changes them waits for that copy.
    writer = CheckpointWriter(background=t.async_checkpoint)
    train_step = TrainStep(model, train_model, optimizer, scheduler, device, cfg.precision,
                           t.grad_clip_norm, ema, before_update=writer.hold_until_copied,
                           skip_nonfinite=t.skip_nonfinite)
    losses = FiniteLosses()
    eval_model = ema.module if ema is not None else model  # EMA weights validate when enabled
    callbacks = Callbacks.build(cfg)
    run = Run(cfg, run_dir, device, model, eval_model, optimizer, data,
              global_batch=data.batch_size * world_size * accumulate, total_steps=int(total_steps))
    watchdog.follow(run)  # the stall watchdog names run.step

    def finished() -> bool:
        return stopped_early is not None or (t.max_steps is not None and step >= t.max_steps) or (
            t.max_epochs is not None and epoch >= t.max_epochs)

    # Resume (everything, exactly) or load weights only (a new schedule), or start fresh.
    step = epoch = batch_in_epoch = 0
    stopped_early: str | None = None  # why a callback ended the run (early stopping)
    best: float | None = None
    resume_from, state = None, None
    ckpt_dir = run_dir / "checkpoints"
    checkpoint.check_layout(ckpt_dir)  # before training, not at its first save
    if cfg.resume == "auto":
        resume_from, state = checkpoint.latest_valid(ckpt_dir) or (None, None)
    elif cfg.resume is not None:
        resume_from, state = Path(cfg.resume), checkpoint.load(cfg.resume, resume=True)
    if resume_from is not None:
        checkpoint.load_model_weights(model, state, resume_from)
        checkpoint.load_optimizer_state(optimizer, state, resume_from, cfg.optimizer)
        scheduler.load_state_dict(state["scheduler"])
        train_step.load_state_dict(state.get("train_step", {}))
        step, epoch, batch_in_epoch = (state["loop"][k] for k in ("step", "epoch", "batch"))
        stopped_early = state["loop"].get("stopped_early")
        callbacks.load_state_dict(state.get("callbacks", {}))
        best = state["best"]
        if len(state["rng"]) == world_size:
            set_rng_state(state["rng"][rank])
        else:
            log.warning("checkpoint has random states of %d ranks, this run has %d: the run "
                        "continues, but not bit-identically", len(state["rng"]), world_size)
        log.info("resumed from %s at step %d (epoch %d)", resume_from, step, epoch)
        if dist.is_main():
            checkpoint.repair_names(ckpt_dir, resume_from, state)
        if finished():  # a finished job run again (a re-run sweep): nothing to train
            log.info("already finished at step %d%s: nothing to train", step,
                     f" ({stopped_early})" if stopped_early else "")
    elif cfg.ckpt is not None:
        checkpoint.load_model_weights(model, checkpoint.load(cfg.ckpt), cfg.ckpt,
                                      strict=cfg.ckpt_strict, fine_tuning=True)
        if ema is not None:
            ema.module.load_state_dict(model.state_dict())
        log.info("loaded weights from %s; training starts a new schedule", cfg.ckpt)

    logger = MetricLogger(run_dir, cfg.logger, step if resume_from else None) \
        if dist.is_main() else None
    if logger is not None:
        logger.log_text("config", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    config_record = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
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
        bar = tqdm(total=int(total_steps), initial=step, unit="step", dynamic_ncols=sized,
                   ncols=None if sized else 80, nrows=None if sized else 24)

    def save(val_metrics: dict[str, float] | None, is_best: bool, last: bool) -> None:
        rng = dist.all_gather_object(rng_state())  # every rank's, for an exact resume
        if dist.is_main():
            write_checkpoint(rng, val_metrics, is_best)
        if last:
            writer.wait()
            # No rank exits while rank 0 still writes: under SLURM a task that exits early gets
            # its peers killed, rank 0 and its half-written file included.
            dist.barrier()

    def write_checkpoint(rng: list, val_metrics: dict[str, float] | None, is_best: bool) -> None:
        state = {
            "format": checkpoint.FORMAT_VERSION,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "train_step": train_step.state_dict(),
            "loop": {"step": step, "epoch": epoch, "batch": batch_in_epoch,
                     "stopped_early": stopped_early},
            "callbacks": callbacks.state_dict(),
            "best": best,
            "is_best": is_best,  # what `checkpoint.repair_names` gives best.pt after a crash
            "metrics": val_metrics or {},
            "rng": rng,
            "config": config_record,
        }
        path = ckpt_dir / checkpoint.periodic_name(step)

        def name_and_prune() -> None:
            # last.pt first: a crash before best.pt leaves a last.pt that records it was the
            # best, and the resume names it (the other order could leave a best.pt from a
            # step that the resume trains again, differently).
            checkpoint.link(path, ckpt_dir / "last.pt")
            if is_best:
                checkpoint.link(path, ckpt_dir / "best.pt")
            checkpoint.prune(ckpt_dir, t.keep_last)

        blocked = writer.save(state, path, then=name_and_prune,
                              changed_only_by_step=_changed_only_by_step(model, optimizer, ema))
        log.debug("checkpoint %s: the loop waited %.3f s", path.name, blocked)

    log.info(
        "training %s on %s x %d: %d steps/epoch, %d steps, %d train / %d val samples",
        cfg.model["_target_"], device.type, world_size, steps_per_epoch, total_steps,
        len(data.train), len(data.val),
    )
    model.train()
    run.step, run.epoch = step, epoch
    with StopRequest() as stop, callbacks.running(run):
        while not finished():
            # Each epoch's order comes from (seed, epoch) alone, so a resumed run sees the same
            # batches; skipping on the sampler never loads the batches already trained on.
            sampler.set_epoch(epoch, skip=batch_in_epoch * accumulate * data.batch_size)
            train_loader.generator.manual_seed((cfg.seed * 100_003 + epoch) * 1009 + rank)
            data.set_epoch(epoch, cfg.seed)
            micro_batches = iter(train_loader)
            for _ in range(steps_per_epoch - batch_in_epoch):
                loss = train_step([next(micro_batches) for _ in range(accumulate)])
                step += 1
                if not t.skip_nonfinite:
                    losses.check(loss, step)  # raises for an earlier step's non-finite loss
                batch_in_epoch += 1
                epoch_end = batch_in_epoch == steps_per_epoch
                if epoch_end:
                    epoch, batch_in_epoch = epoch + 1, 0
                run.step, run.epoch = step, epoch
                for hook in callbacks.on_step_end:
                    hook(run, step, loss)
                done = finished()

                if bar is not None:
                    bar.update()
                if _every(t.log_every_n_steps, step) or done:
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

                validate = done or _every(t.val_every_n_steps, step) or (
                    epoch_end and _every(t.val_every_n_epochs, epoch))
                val_metrics, is_best = None, False
                if validate:
                    val_metrics, _ = evaluate(eval_model, val_loader, device)
                    if logger is not None:
                        logger.log(step, epoch, "val", val_metrics)
                    is_best = _improved(val_metrics[metric], best, t.monitor_mode)
                    if is_best:
                        best = val_metrics[metric]
                    log.info("step %d epoch %d: val loss %.4f acc %.4f%s", step, epoch,
                             val_metrics["loss"], val_metrics["acc"], " (best)" if is_best else "")
                    if callbacks:
                        stopped_early = callbacks.validation_end(
                            run, step, {f"val/{k}": v for k, v in val_metrics.items()})
                        if stopped_early is not None:
                            log.info("step %d: %s", step, stopped_early)
                            done = True

                stopping = stop.should_stop()
                if done or stopping or is_best or _every(t.ckpt_every_n_steps, step) or (
                        epoch_end and _every(t.ckpt_every_n_epochs, epoch)):
                    with watchdog.waiting():  # (a wait for the device, as above)
                        losses.flush()  # never a checkpoint of weights a non-finite loss made
                    save(val_metrics, is_best, last=done or stopping)
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
    if writer.saves:
        log.info("%d checkpoint(s) %s; the loop waited %.3f s for them in all",
                 writer.saves, "written in the background" if t.async_checkpoint else "written",
                 writer.waited_s)
    if logger is not None:
        logger.close()
        draw_curves(run_dir)
    log.info("done: step %d, best %s %s", step, t.monitor, best)
    return best
