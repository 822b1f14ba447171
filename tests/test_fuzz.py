"""Override fuzzing (slow): generated override sets, valid and invalid, through the real CLI.
Each either runs (tiny settings) or fails with a short error and a non-zero exit; none hangs,
none prints a traceback."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO

SETS = 200
# A few steps of everything: a valid set runs in the time of its start-up.
TINY_RUN = ["trainer.max_epochs=null", "trainer.max_steps=3",
            "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
            "trainer.val_every_n_epochs=null", "trainer.val_every_n_steps=3",
            "data.val_batch_size=512"]

# Changes that must run, alone or together.
VALID = {
    "model": ["cnn", "mlp"], "optimizer": ["adamw", "sgd"],
    "scheduler": ["cosine", "step", "constant"], "optimizer.lr": ["0.01", "3e-4"],
    "seed": ["0", "7", "123456", "4294967295"], "data.shift": ["0", "1"],
    "precision": ["32", "bf16-mixed"], "trainer.ema": ["true", "false"],
    "trainer.accumulate_grad_batches": ["1", "2"], "trainer.grad_clip_norm": ["null", "1.0"],
    "data.batch_size": ["16", "64"], "trainer.keep_last": ["0", "1"],
    "trainer.skip_nonfinite": ["true"], "logger": ["csv", "tensorboard"],
    "trainer.async_checkpoint": ["true", "false"], "deterministic": ["true"],
    "trainer.monitor_mode": ["min", "max"], "data.num_workers": ["0", "1"],
    "trainer.ckpt_every_n_steps": ["1", "2"], "detail": ["true"],
    "callbacks": ["default", "none"], "+callbacks/early_stopping": ["default"],
    "+callbacks/eval_visuals": ["default"], "+callbacks/lr_throughput": ["default"],
    "device_id": ["0"], "distributed.strategy": ["ddp", "fsdp"],
    "trainer.activation_checkpointing": ["[Linear]", "[]"],
}

# Each of these must make a set fail: (override, a word the error must contain).
WRONG_TYPE = [("trainer.max_steps=abc", "trainer.max_steps"), ("devices=two", "devices"),
              ("optimizer.lr=fast", "fast"), ("trainer.ema=maybe", "ema"),
              ("trainer.keep_last=1.5", "keep_last"), ("model.channels=8", "channels"),
              ("data.batch_size=[1,2]", "batch_size"), ("nodes=[1]", "nodes"),
              ("trainer.max_steps=3.7", "max_steps"), ("seed=true", "seed"),
              ("distributed.timeout_s=soon", "timeout_s"), ("data.input_shape=abc", "input_shape")]
UNKNOWN = [("trainer.epochs=3", "epochs"), ("+trainer.epochs=3", "epochs"), ("+foo=1", "foo"),
           ("model=resnet50", "resnet50"), ("optimizer=lamb", "lamb"),
           ("logger=neptune", "neptune"),
           ("+nogroup=x", "nogroup"), ("distributed.bakend=gloo", "bakend"),
           ("+logger.nope=1", "nope"), ("scheduler=onecycle", "onecycle"),
           ("model.widht=3", "widht"), ("data.batchsize=3", "batchsize"),
           ("trainer.max_epoch={i}", "did you mean trainer.max_epochs?"),
           ("model.chanels=[{i}]", "did you mean model.channels?"),
           ("modle.dropout=0.{i}", "did you mean model.dropout?")]
OUT_OF_RANGE = [("optimizer.lr=-{f}", "optimizer.lr"), ("devices=0", "devices"),
                ("data.batch_size=-{i}", "batch_size"), ("data.batch_size=0", "batch_size"),
                ("data.val_fraction=1.{i}", "val_fraction"), ("trainer.keep_last=-{i}",
                                                               "keep_last"),
                ("nodes=0", "nodes"), ("machine_rank={i}", "machine_rank"),
                ("trainer.ema_decay=1.{i}", "ema_decay"), ("data.num_workers=-{i}",
                                                           "num_workers"),
                ("occupy=1.{i}", "occupy"), ("distributed.timeout_s=0", "timeout_s"),
                ("seed=-{i}", "seed"), ("trainer.max_steps=0", "max_steps"),
                ("trainer.accumulate_grad_batches=0", "accumulate_grad_batches"),
                ("model.dropout=1.{i}", "dropout"), ("optimizer.momentum=-{f}", "momentum"),
                ("trainer.log_every_n_steps=-{i}", "log_every_n_steps"),
                ("data.num_samples={i}", "num_samples"),
                ("data.val_fraction=0.0000{i}", "the minimum is"),
                ("seed=9223372036854775807", "0 to 4294967295"), ("seed=4294967296", "seed"),
                ("data.split_seed=-{i}", "data.split_seed")]
ODD = [("model.hidden=[", "["), ("seed=${{oops}}", "oops"), ("trainer.monitor=val/nope{i}",
                                                             "val/nope"),
       ("dist_url=http://x:{i}", "dist_url"), ("accelerator=tpu{i}", "accelerator"),
       ("precision=64", "precision"), ("ckpt=/no/such/file{i}.pt", "file"),
       ("resume=/no/such/run{i}.pt", "run"), ("predict.input=Ω{i}", "predict.input"),
       ("model._target_=nope.Nope{i}", "nope"), ("model._target_=os.getcwd", "model"),
       ("distributed.start_method=thread", "start_method"), ("data.input_shape=[]", "input"),
       ("trainer=predict", "ckpt"), ("model.channels=[0,16]", "channels"),
       ("data.root=/no/such/dir{i}", "root"), ("dist_url=tcp://:{i}", "dist_url"),
       ("precision=' 32'", "precision"), ("optimizer.lr='1e-3 '", "lr"),
       ("trainer.monitor_mode=sideways", "sideways"), ("devices=auto{i}", "devices"),
       ("callbacks=fancy{i}", "fancy"), ("+callbacks/nope{i}=default", "nope"),
       ("+callbacks.x._target_=nope.Nope{i}", "callbacks.x"), ("device_id=-{i}", "device_id"),
       ("device_id={i}", "device_id"), ("callbacks.model_summary.depth=deep", "depth")]
INVALID = WRONG_TYPE + UNKNOWN + OUT_OF_RANGE + ODD


def _generate(rng: random.Random) -> list[tuple[list[str], str | None]]:
    """SETS distinct override sets: (overrides, a word the error must hold; None: must run)."""
    sets, seen = [], set()
    while len(sets) < SETS:
        keys = rng.sample(sorted(VALID), rng.randint(0, 3))
        valid = [f"{k}={rng.choice(VALID[k])}" for k in keys]
        word = None
        if rng.random() < 0.75:
            template, word = rng.choice(INVALID)
            bad = template.format(i=rng.randint(1, 99), f=round(rng.uniform(0.001, 5), 3))
            key = bad.split("=")[0].lstrip("+")
            valid = [v for v in valid if v.split("=")[0] not in (key, key.split(".")[0])]
            valid.insert(rng.randint(0, len(valid)), bad)
        if tuple(valid) not in seen:
            seen.add(tuple(valid))
            sets.append((valid, word))
    return sets


def _run(overrides: list[str], run_dir) -> subprocess.CompletedProcess | str:
    cmd = [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY_RUN, *overrides]
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "hung: no exit within 180 s"


def _problem(result: subprocess.CompletedProcess | str, word: str | None) -> str | None:
    if isinstance(result, str):
        return result
    output = result.stdout + result.stderr
    if word is None:
        return None if result.returncode == 0 else f"exit {result.returncode}: {output[-1500:]}"
    if result.returncode == 0:
        return f"ran, but should have failed naming {word!r}"
    if "Traceback" in output:
        return f"traceback: {output[-1500:]}"
    # The error: from the app's [ERROR] line, or Hydra's whole message without its pointer
    # to a full-traceback switch; a few lines at most (Hydra lists the options of a group).
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "][ERROR]" in line), 0)
    # (Hydra lists a group's options one per line, indented: a list, not a wall of text.)
    error = [line for line in lines[first:] if line.strip() and "HYDRA_FULL_ERROR" not in line
             and not line.startswith("\t")]
    if len(error) > 12:
        return f"{len(error)} lines of error: {output[-1500:]}"
    if word.lower() not in output.lower():
        return f"the error does not name {word!r}: {output[-1500:]}"
    return None


@pytest.mark.slow
def test_generated_override_sets_run_or_fail_cleanly(tmp_path) -> None:
    sets = _generate(random.Random(2026))
    with ThreadPoolExecutor(max_workers=3) as pool:  # start-up waits on I/O as well as CPU
        results = list(pool.map(lambda i: _run(sets[i][0], tmp_path / f"set{i}"),
                                range(len(sets))))
    problems = [f"{' '.join(overrides)} -> {problem}"
                for (overrides, word), result in zip(sets, results, strict=True)
                if (problem := _problem(result, word)) is not None]
    ran = sum(1 for r in results if not isinstance(r, str) and r.returncode == 0)
    print(f"fuzz: {len(sets)} override sets, {ran} ran, {len(sets) - ran} failed cleanly, "
          f"{len(problems)} problems")
    assert not problems, "\n".join(problems)
