"""NaN forensics by replay: train again, from the newest checkpoint before a run's first
non-finite loss, to that step, and name what went non-finite there.

Exact resume makes it possible: a checkpoint restores the weights, the optimizer, the loop's
position and every random state, and an epoch's batches come from (seed, epoch) alone
(`ResumableSampler`), so the replayed steps are the run's own, bit for bit (a step compiled by
`compile=true` too: only the bad step runs eagerly). The steps before the bad one train as the
loop does (`TrainStep`); the bad step runs its forward with a hook on every module and its
backward under `torch.autograd.detect_anomaly`, on the unwrapped model, so that nothing here
waits for another rank. The loop itself pays nothing for any of it.

With several ranks (`trainer.replay_nonfinite=true`) every rank replays its own batches (DDP
averages their gradients as in the run, so the replay stays exact) and rank 0 writes what each
rank found."""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app import dist
from app.checkpoint import io
from app.checkpoint.manager import CheckpointManager
from app.config import AppConfig
from app.errors import UserError
from app.training.loop import build_training, epoch_batches
from app.training.state import last_step
from app.training.step import TrainStep

log = logging.getLogger(__name__)

# The words of the loop's stop at a non-finite loss (app.training.step.FiniteLosses).
STOPPED = re.compile(r"the training loss was (\S+) at step (\d+)")
REPORT = Path("logs") / "nonfinite.json"


def stopped_at(text: str) -> int | None:
    """The step a run stopped at for a non-finite loss, from its error's words; else None."""
    found = STOPPED.search(text)
    return int(found[2]) if found else None


def checkpoints_before(directory: Path, step: int) -> list[Path]:
    """The periodic checkpoints written before `step` (files or sharded directories), the
    newest first."""
    steps = {}
    for path in directory.glob("step-*"):
        number = re.fullmatch(r"step-(\d+)(\.pt)?", path.name)
        if number and int(number[1]) < step and io.is_checkpoint(path):
            steps[int(number[1])] = path
    return [steps[k] for k in sorted(steps, reverse=True)]


class _FirstNonFinite:
    """Forward hooks on every module of `model`: the first module (in the order the forward
    ran them, so the innermost first) whose output held a NaN or an inf, and which rows of
    its micro-batch; and the order the modules ran in."""

    def __init__(self, model: nn.Module) -> None:
        self.found: dict[str, Any] | None = None
        self.order: dict[str, int] = {}  # module name: when its forward ended first
        self.handles = [module.register_forward_hook(self._hook(name))
                        for name, module in model.named_modules()]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            self.order.setdefault(name, len(self.order))
            if self.found is not None:
                return
            tensors = [t for t in (output if isinstance(output, tuple | list) else (output,))
                       if isinstance(t, torch.Tensor) and t.is_floating_point()]
            bad = [t for t in tensors if not bool(torch.isfinite(t).all())]
            if bad:
                self.found = {"module": name or "(the model)", "type": type(module).__name__,
                              "rows": _bad_rows(bad[0])}
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _bad_rows(tensor: torch.Tensor) -> list[int]:
    """The positions along the batch dimension (the first) that hold a non-finite value."""
    if tensor.ndim == 0:
        return []
    return torch.nonzero(~torch.isfinite(tensor.detach()).reshape(len(tensor), -1).all(1)
                         ).flatten().tolist()


def _watched_step(model: nn.Module, train_step: TrainStep,
                  micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                  indices: list[list[int]]) -> dict[str, Any]:
    """A step's forward and backward (no update), watched: what went non-finite first."""
    found: dict[str, Any] = {}
    hooks = _FirstNonFinite(model)
    losses, bad_samples = [], []
    moved = [(x.to(train_step.device, dtype=train_step.input_dtype), y.to(train_step.device))
             for x, y in micro_batches]
    try:
        for batch, ((x, y), ids) in enumerate(zip(moved, indices, strict=True)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # (anomaly mode warns the forward's trace)
                with torch.autograd.detect_anomaly(check_nan=True):
                    with train_step.autocast:
                        output = model(x)
                        loss = F.cross_entropy(output, y)
                    losses.append(loss.item())
                    per_sample = F.cross_entropy(output.detach().float(), y, reduction="none")
                    bad_samples += [ids[i] for i in _bad_rows(per_sample)]
                    if hooks.found is not None and "micro_batch" not in hooks.found:
                        # (an output whose first dimension is not the batch names no sample)
                        hooks.found.update(micro_batch=batch, samples=[
                            ids[i] for i in hooks.found.pop("rows") if i < len(ids)])
                    try:
                        (loss / len(moved)).backward()
                    except RuntimeError as e:  # anomaly mode: a backward op returned NaN
                        if "gradient" not in found:
                            found["gradient"] = {"backward_op": str(e).split("\n")[0],
                                                 "micro_batch": batch,
                                                 "forward_trace": _forward_trace(caught)}
        hooks.remove()
        if "gradient" in found:  # (anomaly mode stopped a backward: the gradients, whole)
            train_step.optimizer.zero_grad(set_to_none=True)
            for x, y in moved:
                with train_step.autocast:
                    loss = F.cross_entropy(model(x), y)
                (loss / len(moved)).backward()
        # An inf gradient (anomaly mode looks for NaN only), or a NaN's: by parameter. A NaN
        # spreads to the gradients of every module the forward ran before the one that made
        # it: that one is the last of them to run.
        bad = [name for name, p in model.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            owner = max((name.rpartition(".")[0] for name in bad),
                        key=lambda name: hooks.order.get(name, -1))
            found.setdefault("gradient", {}).update(
                parameters=bad, module=owner or "(the model)",
                type=type(model.get_submodule(owner)).__name__)
    finally:
        hooks.remove()
        train_step.optimizer.zero_grad(set_to_none=True)
    found["loss"] = math.fsum(losses) / len(losses)
    found["samples_with_nonfinite_loss"] = bad_samples
    if hooks.found is not None:
        found["output"] = hooks.found
    return found


def _finite_weights(model: nn.Module) -> bool:
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


def _forward_trace(caught: list[warnings.WarningMessage]) -> list[str]:
    """The last lines of the forward call's traceback that anomaly mode warns with."""
    for warning in caught:
        text = str(warning.message)
        if "Traceback of forward call" in text:
            lines = [line.strip() for line in text.splitlines()
                     if line.strip() and not line.strip().startswith("(Triggered internally")]
            return lines[-4:]
    return []


def replay(cfg: AppConfig, run_dir: Path, device: torch.device, bad_step: int,
           watch: int | None = None) -> dict[str, Any]:
    """Replay the run of `cfg` in `run_dir` on this process's rank, built as
    app.training.loop.train builds it, to step `watch` (default: `bad_step`, whose loss was
    non-finite), and watch that step; returns what this rank found, with the losses on the
    way. A step before it whose update left non-finite weights ends the replay there
    (`weights_nonfinite_after`): that step is the one to watch."""
    t = cfg.trainer
    if dist.world_size() > 1 and (cfg.distributed.strategy == "fsdp" or
                                  cfg.distributed.sync_batchnorm):
        raise UserError("the replay of a non-finite loss with several ranks runs under "
                        "distributed.strategy=ddp without sync_batchnorm (a rank's watched "
                        "step would wait for the others' collectives)")
    # The newest checkpoint before the step whose weights are finite (a step with a finite
    # loss may have saved the weights an infinite gradient made), or where the run started
    # (ckpt=: its weights loaded again).
    for start in [*checkpoints_before(run_dir / "checkpoints", bad_step), None]:
        cfg = dataclasses.replace(cfg, resume=None if start is None else str(start))
        built = build_training(cfg, device)  # (as the run was built: its random draws too)
        # The loop's parts but its callbacks (none of them changes what a step computes).
        CheckpointManager(run_dir / "checkpoints", cfg, built.parts()).restore()
        if _finite_weights(built.model):
            break
        log.warning("%s holds non-finite weights: replaying from an earlier checkpoint", start)
    accumulate = t.accumulate_grad_batches
    data, model, state, train_step = built.data, built.model, built.state, built.train_step
    train_loader, sampler = built.train_loader, built.sampler
    steps_per_epoch, global_batch = built.steps_per_epoch, built.global_batch
    if state.rebatch(global_batch, steps_per_epoch) is not None:
        raise UserError(f"the run's checkpoint {start} has steps of another size than this "
                        f"replay's: replay with the devices, batch size and accumulation "
                        f"the run had")
    end = last_step(state, t, steps_per_epoch)
    if (watch or bad_step) > end or (watch or bad_step) <= state.step:
        raise UserError(f"step {watch or bad_step} is not one the run trains after "
                        f"{start or 'its start'}: it ends at step {end}")
    log.info("replaying from %s (step %d) to step %d, rank %d", start or "the start",
             state.step, bad_step, dist.rank())
    model.train()
    losses: dict[int, float] = {}
    per_step = data.batch_size * accumulate
    while True:
        micro_batches = epoch_batches(cfg, state, data, train_loader, sampler)
        order = list(iter(sampler))  # this rank's sample indices for the rest of the epoch
        for k in range(steps_per_epoch - state.batch_in_epoch):
            batch = [next(micro_batches) for _ in range(accumulate)]
            ids = order[k * per_step:(k + 1) * per_step]
            indices = [ids[i:i + data.batch_size] for i in range(0, per_step, data.batch_size)]
            head = {"step": state.step + 1, "rank": dist.rank(), "epoch": state.epoch,
                    "replayed_from": str(start) if start else None}
            if state.step + 1 == (watch or bad_step):  # (`model`: no compiled or DDP wrapper)
                found = _watched_step(model, train_step, batch, indices)
                return {**head, "samples": [i for part in indices for i in part], **found,
                        "losses_before": losses}
            losses[state.step + 1] = train_step(batch).item()
            state.advance(steps_per_epoch)
            # (With several ranks every rank holds the same weights: all of them stop here.)
            if watch is None and not _finite_weights(model):
                return {**head, "weights_nonfinite_after": state.step}


def write_report(cfg: AppConfig, run_dir: Path, device: torch.device, bad_step: int) -> Path:
    """Replay on every rank, and write what they found to RUN_DIR/logs/nonfinite.json (rank
    0): the first rank whose replay names a module, or failing that, a backward op. Weights
    that an earlier step's update made non-finite (a non-finite gradient under a finite loss)
    are replayed again, to that step, and it is watched."""
    mine = replay(cfg, run_dir, device, bad_step)
    if "weights_nonfinite_after" in mine:
        mine = replay(cfg, run_dir, device, bad_step, watch=mine["weights_nonfinite_after"])
    ranks = [_plain(r) for r in dist.all_gather_object(mine)]
    path = run_dir / REPORT
    if dist.is_main():
        first = next((r for r in ranks if "output" in r), None) or \
            next((r for r in ranks if "gradient" in r), ranks[0])
        summary = {"step": first["step"], "stopped_at": bad_step, "rank": first["rank"],
                   **_culprit(first), "samples": first["samples"],
                   "samples_with_nonfinite_loss": first["samples_with_nonfinite_loss"],
                   "losses_match_run": _same_losses(run_dir, mine["losses_before"])
                   if len(ranks) == 1 else None,
                   "ranks": ranks}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def _plain(found: dict[str, Any]) -> dict[str, Any]:
    """`found` for strict JSON: a NaN or inf loss as its word ("nan", "inf")."""
    loss = found.get("loss")
    return {**found, "loss": loss if loss is None or math.isfinite(loss) else str(loss)}


def _same_losses(run_dir: Path, losses: dict[int, float]) -> bool | None:
    """Whether the replayed losses are the run's own, at the steps metrics.csv logged (None:
    none of them logged): a replay that is not exact says so."""
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            logged = {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)
                      if row.get("split") == "train" and int(row["step"]) in losses}
    except (OSError, KeyError, ValueError):
        return None
    return all(losses[step] == loss for step, loss in logged.items()) if logged else None


def describe(report: dict[str, Any]) -> str:
    """What a nonfinite.json found, in one line."""
    where = f" (rank {report['rank']})" if len(report["ranks"]) > 1 else ""
    if report["step"] != report["stopped_at"]:
        where += f", whose update made the weights non-finite (the loss: at step " \
                 f"{report['stopped_at']})"
    if report["found_in"] == "output":
        what = (f"the first non-finite output was {report['module']} ({report['type']}), "
                f"at {_samples(report['module_samples'], report['samples'])}")
    elif report["found_in"] == "gradient":
        what = "the outputs were finite; the first non-finite gradient was made in " + \
            (f"{report['module']} ({report['type']})" if report["module"] else "the backward")
        op = re.search(r"Function '(\w+)'", report["backward_op"] or "")
        if op:
            what += f" by {op[1]}"
    elif report["found_in"] == "loss":
        what = "the outputs and gradients were finite; the loss function made the NaN/inf"
    else:
        what = "the replayed step's loss was finite: the run's non-finite loss did not repeat"
    if report["losses_match_run"] is False:
        what += " (the replayed losses before it differ from the run's: not an exact replay)"
    return f"step {report['step']}{where}: {what}"


def _samples(bad: list[int], batch: list[int]) -> str:
    if len(bad) == len(batch):
        return f"every sample of the batch ({len(batch)})"
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    return f"sample{'s' if len(bad) > 1 else ''} {shown} of the data set"


def _culprit(found: dict[str, Any]) -> dict[str, Any]:
    if "output" in found:
        return {"found_in": "output", "module": found["output"]["module"],
                "type": found["output"]["type"], "module_samples": found["output"]["samples"]}
    if "gradient" in found:
        gradient = found["gradient"]
        return {"found_in": "gradient", "module": gradient.get("module"),
                "type": gradient.get("type"), "backward_op": gradient.get("backward_op"),
                "parameters": gradient.get("parameters", [])}
    return {"found_in": "loss" if isinstance(found["loss"], str) else None}


def replay_after(error: BaseException, cfg: AppConfig, run_dir: Path,
                 device: torch.device) -> None:
    """`trainer.replay_nonfinite=true`: the replay at once, when `error` is the loop's stop
    at a non-finite loss. A replay that fails is logged: the run's error stays its own."""
    step = stopped_at(str(error))
    if step is None:
        return
    # The loop's frames, which the error's traceback holds, hold its model, optimizer and
    # batches: let them go before the replay builds its own (the device's memory, twice). An
    # AppError is reported as its line, without the traceback.
    error.__traceback__ = None
    gc.collect()
    try:
        path = write_report(cfg, run_dir, device, step)
    except Exception as e:
        log.warning("the replay of step %d failed: %s", step, e)
        return
    if dist.is_main():
        log.info("replayed: %s; details in %s", describe(json.loads(path.read_text())), path)
