"""`make bench`: the app against baselines run side by side; writes BENCHMARKS.md.

    python bench/run.py [--repeats 3] [--out BENCHMARKS.md]

Every figure is the median of `repeats` runs with their range; app and baseline runs
alternate, so that drifts of a noisy machine hit both. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ckpt_stall
from common import BENCH, Stat, app_cmd, machine, ratio_range, run_probed

REPO = BENCH.parent
CNN_STEPS, MLP_STEPS, DDP_STEPS = 300, 80, 200
MLP = {"hidden": [1024, 1024], "num_samples": 16384, "input_shape": [3, 32, 32], "batch": 512}


def plain_cmd(*args: str) -> list[str]:
    return [sys.executable, str(BENCH / "plain_loop.py"), *args]


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "**missed**"


def step_overhead(tmp: Path, repeats: int) -> tuple[str, dict]:
    """(a) digits CNN at batch 64, (b) an MLP on synthetic data at batch 512: the app's loop
    (default logging, progress and checkpoint settings) against bench/plain_loop.py."""
    m = MLP
    cases = {
        "CNN, digits, batch 64": (
            CNN_STEPS, [f"trainer.max_steps={CNN_STEPS}"], ["--steps", str(CNN_STEPS)]),
        f"MLP {m['hidden']}, synthetic {m['input_shape']}, batch {m['batch']}": (
            MLP_STEPS,
            ["model=mlp", f"model.hidden={json.dumps(m['hidden'])}", "data=synthetic",
             f"data.num_samples={m['num_samples']}",
             f"data.input_shape={json.dumps(m['input_shape'])}",
             f"data.batch_size={m['batch']}", f"trainer.max_steps={MLP_STEPS}"],
            ["--model", "mlp", "--hidden", json.dumps(m["hidden"]), "--data", "synthetic",
             "--num-samples", str(m["num_samples"]), "--input-shape",
             json.dumps(m["input_shape"]), "--batch", str(m["batch"]),
             "--steps", str(MLP_STEPS)]),
    }
    rows, runs = [], {}
    for i, (name, (steps, app_args, plain_args)) in enumerate(cases.items()):
        apps, plains, parity = [], [], []
        for r in range(repeats):
            run_dir = tmp / f"steps{i}-{r}"
            apps.append(run_probed(app_cmd(*app_args, f"hydra.run.dir={run_dir}"), steps, REPO))
            losses = tmp / f"plain{i}-{r}.json"
            plains.append(run_probed(plain_cmd(*plain_args, "--losses", str(losses)), steps,
                                     REPO))
            parity.append(_same_losses(run_dir / "metrics.csv", losses))
        runs[i] = (apps, plains)
        a, p = Stat([x.step_s for x in apps]), Stat([x.step_s for x in plains])
        ratio = a.median / p.median
        rows.append(f"| {name} | {p.fmt(1e3)} | {a.fmt(1e3)} | {ratio_range(a, p)} | "
                    f"{verdict(ratio, 1.03)} | {'identical' if all(parity) else '**differ**'} |")
    table = ("| case | plain loop ms/step | app ms/step | ratio | target 1.03 | losses |\n"
             "|---|---|---|---|---|---|\n" + "\n".join(rows))
    return table, runs


def _same_losses(metrics: Path, plain_losses: Path) -> bool:
    plain = json.loads(plain_losses.read_text())
    logged = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(metrics.open())
              if r["split"] == "train"]
    return bool(logged) and all(plain[step - 1] == loss for step, loss in logged)


def floor(modules: str) -> float:
    """Process start to the end of `import <modules>`."""
    start = time.time()
    out = subprocess.run([sys.executable, "-c", f"import {modules}, time; print(time.time())"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    return float(out) - start


def timeline(tmp: Path) -> list[tuple[str, float]]:
    proc = subprocess.run([sys.executable, str(BENCH / "timeline.py"), "trainer.max_steps=1",
                           f"hydra.run.dir={tmp / 'timeline'}"], capture_output=True, text=True,
                          cwd=REPO, check=True)
    return json.loads(proc.stderr.strip().splitlines()[-1])


def startup(tmp: Path, repeats: int) -> str:
    """Time to the end of the first optimizer step; floors, plain loop and app interleaved."""
    first = {"app": [], "plain": [], "floor": [], "dynamo": []}
    exit_early = {"APP_PROBE_EXIT": "1"}
    for r in range(repeats):
        first["floor"].append(floor("torch, hydra"))
        first["dynamo"].append(floor("torch, hydra, torch._dynamo"))
        first["plain"].append(run_probed(plain_cmd("--steps", "1"), 1, REPO,
                                         env=exit_early).first_step_s)
        first["app"].append(run_probed(app_cmd(f"hydra.run.dir={tmp / f'first-{r}'}"), 1, REPO,
                                       env=exit_early).first_step_s)
    app, plain = Stat(first["app"]), Stat(first["plain"])
    base, with_dynamo = Stat(first["floor"]), Stat(first["dynamo"])
    marks = timeline(tmp)
    at = dict(marks)
    spans = [("interpreter start", 0.0, at["interpreter ready"]),
             ("import hydra", at["import hydra begins"], at["import hydra ends"])]
    composes = [(b, e) for (lb, b), (le, e) in zip(marks, marks[1:], strict=False)
                if lb == "compose begins" and le == "compose ends"]
    spans += [(f"Hydra compose #{i + 1}", b, e) for i, (b, e) in enumerate(composes)]
    spans += [("Hydra job set-up, config check", composes[-1][1], at["import torch begins"]),
              ("import torch (with numpy)", at["import torch begins"], at["import torch ends"]),
              ("build data + model", at["build_data begins"], at["build_model ends"]),
              ("import torch._dynamo (first optimizer use, PyTorch's own)",
               at["import torch._dynamo begins"], at["import torch._dynamo ends"]),
              ("first step", at["build_optimizer ends"], at["first step ends"])]
    breakdown = "\n".join(f"| {name} | {e - b:.2f} |" for name, b, e in spans)
    above = app.median - base.median
    return f"""| process start to end of first optimizer step | seconds |
|---|---|
| floor: `python -c "import torch, hydra"` | {base.fmt()} |
| floor + `torch._dynamo` (imported by every optimizer's first use) | {with_dynamo.fmt()} |
| plain loop (bench/plain_loop.py) | {plain.fmt()} |
| `python -m app` (default job) | {app.fmt()} |
| app above the floor (target 1.0) | {above:.2f}: {verdict(above, 1.0)} |
| app above floor + dynamo | {app.median - with_dynamo.median:.2f} |
| app above the plain loop | {app.median - plain.median:.2f} |

Where the time goes (one run of bench/timeline.py, seconds):

| stage | s |
|---|---|
{breakdown}
| total to the end of the first step | {at["first step ends"]:.2f} |"""


def ddp_and_spawn(tmp: Path, repeats: int) -> str:
    common = [f"trainer.max_steps={DDP_STEPS}", "distributed.omp_threads=1"]
    ones, twos, spawned = [], [], []
    for r in range(repeats):
        ones.append(run_probed(app_cmd(*common, f"hydra.run.dir={tmp / f'd1-{r}'}"),
                               DDP_STEPS, REPO, env={"OMP_NUM_THREADS": "1"}))
        twos.append(run_probed(app_cmd(*common, "devices=2", f"hydra.run.dir={tmp / f'd2-{r}'}"),
                               DDP_STEPS, REPO, env={"OMP_NUM_THREADS": "1"}))
    for r in range(max(1, repeats - 1)):
        spawned.append(run_probed(app_cmd(*common, "devices=2", "distributed.start_method=spawn",
                                          f"hydra.run.dir={tmp / f'sp-{r}'}"),
                                  DDP_STEPS, REPO, env={"OMP_NUM_THREADS": "1"}))
    one, two = Stat([x.step_s for x in ones]), Stat([x.step_s for x in twos])
    f1, f2 = Stat([x.first_step_s for x in ones]), Stat([x.first_step_s for x in twos])
    fs = Stat([x.first_step_s for x in spawned])
    ddp_ratio, extra = two.median / one.median, f2.median - f1.median
    return f"""### DDP overhead (weak scaling, gloo, 1 thread per process, batch 64 per process)

| | devices=1 | devices=2 | ratio | target 1.15 |
|---|---|---|---|---|
| ms per step (rank 0) | {one.fmt(1e3)} | {two.fmt(1e3)} | {ratio_range(two, one)} \
| {verdict(ddp_ratio, 1.15)} |

### Spawn cost (time to first step, seconds)

| devices=1 | devices=2, forkserver (default) | devices=2, spawn | extra (forkserver) | target 1.0 |
|---|---|---|---|---|
| {f1.fmt()} | {f2.fmt()} | {fs.fmt()} | {extra:.2f} | {verdict(extra, 1.0)} |"""


def checkpoint_stall(tmp: Path, repeats: int) -> str:
    micro = ckpt_stall.measure(repeats)
    size = micro["size_mb"][0]
    plain = Stat(micro["plain"])
    loop = {}
    for mode in ("true", "false"):
        run = run_probed(app_cmd(*ckpt_stall.LOOP_OVERRIDES, f"trainer.async_checkpoint={mode}",
                                 f"hydra.run.dir={tmp / f'ckpt-{mode}'}"),
                         ckpt_stall.LOOP_STEPS, REPO)
        loop[mode] = ckpt_stall.stalls(run.step_times)
    a, s = Stat(loop["true"]), Stat(loop["false"])
    ratio = a.median / plain.median
    return f"""State of {size:.0f} MB (an MLP's weights; SGD, so no optimizer state), seconds:

| | seconds |
|---|---|
| `torch.save` of the state, in the caller's thread (baseline) | {plain.fmt(digits=3)} |
| app's synchronous atomic save (temp file, fsync, rename), alone \
| {Stat(micro['sync']).fmt(digits=3)} |
| app's asynchronous save, caller blocked, alone (copy of the state) \
| {Stat(micro['blocked']).fmt(digits=3)} |
| app's asynchronous save, until the file is on disk | {Stat(micro['write']).fmt(digits=3)} |
| training loop stalled by a checkpoint, trainer.async_checkpoint=false | {s.fmt(digits=3)} |
| training loop stalled by a checkpoint, trainer.async_checkpoint=true | {a.fmt(digits=3)} |
| async stall / `torch.save` (target 0.20) | {ratio:.3f}: {verdict(ratio, 0.20)} |

The stall is the time between the steps around a checkpoint minus the median step time,
measured by the step probe in a real run ({' '.join(ckpt_stall.LOOP_OVERRIDES)})."""


def memory(step_runs: dict) -> str:
    rows = []
    for i, name in ((0, "CNN, digits"), (1, "MLP, synthetic")):
        apps, plains = step_runs[i]
        a, p = Stat([x.peak_rss_mb for x in apps]), Stat([x.peak_rss_mb for x in plains])
        ratio = a.median / p.median
        rows.append(f"| {name} | {p.fmt(digits=0, unit=' MB')} | {a.fmt(digits=0, unit=' MB')} "
                    f"| {ratio_range(a, p)} | {verdict(ratio, 1.10)} |")
    return ("| run | plain loop peak RSS | app peak RSS | ratio | target 1.10 |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = p.parse_args()
    started = time.time()
    sections = {}
    with tempfile.TemporaryDirectory(prefix="app-bench-") as tmp:
        tmp = Path(tmp)
        for name, fn in (("steps", lambda: step_overhead(tmp, args.repeats)),):
            sections[name], step_runs = fn()
            print(sections[name], flush=True)
        for name, fn in (("startup", lambda: startup(tmp, args.repeats)),
                         ("memory", lambda: memory(step_runs)),
                         ("ddp", lambda: ddp_and_spawn(tmp, args.repeats)),
                         ("checkpoint", lambda: checkpoint_stall(tmp, args.repeats))):
            sections[name] = fn()
            print(sections[name], flush=True)
    took = time.time() - started
    args.out.write_text(render(sections, args.repeats, took))
    print(f"wrote {args.out} in {took:.0f} s")


def render(s: dict[str, str], repeats: int, took: float) -> str:
    return f"""# Benchmarks

Written by `make bench` (bench/run.py) on {time.strftime('%Y-%m-%d %H:%M')}, in {took:.0f} s.
Machine: {machine()}.

Each figure: median of {repeats} runs, (min-max) in brackets; app and baseline runs
alternate. Ratios are app / baseline (of the medians; the range is over paired runs).
Timing on this machine is noisy; read the ratios, not the absolute times.

## 1. Step overhead against a plain PyTorch loop

bench/plain_loop.py trains the same model and data classes with the same batch, optimizer
(AdamW, no decay on 1-d parameters), schedule, seed and thread count; the app runs with its
default logging, progress and checkpoint settings (validation and checkpoint each epoch, the
loss logged every 10 steps). Median time per optimizer step after {10} warm-up steps, from
a probe on torch's optimizer-step hook (bench/probe). "losses": the losses the app logged
equal the plain loop's at the same steps, bit for bit.

{s['steps']}

## 2. Time to first step

{s['startup']}

## 3. and 5. Spawn cost and DDP overhead

{s['ddp']}

## 4. Checkpoint stall

{s['checkpoint']}

## 6. Memory

Peak resident memory of the process (os.wait4), for the runs of section 1.

{s['memory']}
"""


if __name__ == "__main__":
    main()
