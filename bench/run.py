"""`make bench`: the app against baselines run side by side; writes BENCHMARKS.md.

    python bench/run.py [--repeats 3] [--out BENCHMARKS.md]

Every figure is the median of `repeats` runs with their range; app and baseline runs
alternate, so that drifts of a noisy machine hit both. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blas_mode
import ckpt_stall
import compile_cache
import fsdp
import image_loader
import step_overhead
from common import BENCH, Stat, app_cmd, machine, paired_ratio, ratio_range, run_probed

REPO = BENCH.parent
CNN_STEPS, MLP_STEPS, DDP_STEPS = 400, 50, 150  # CNN: the default job ends at 440
MLP = {"hidden": [1024, 1024], "num_samples": 16384, "input_shape": [3, 32, 32], "batch": 512}
RESNET_STEPS = 60  # the ResNet [16, 32, 64] on 3x32x32 inputs at batch 64


def plain_cmd(*args: str) -> list[str]:
    return [sys.executable, str(BENCH / "plain_loop.py"), *args]


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "**missed**"


CASES = {
    "CNN, digits, batch 64": (CNN_STEPS, [], []),
    f"MLP {MLP['hidden']}, synthetic {MLP['input_shape']}, batch {MLP['batch']}": (
        MLP_STEPS,
        ["model=mlp", f"model.hidden={json.dumps(MLP['hidden'])}", "data=synthetic",
         f"data.num_samples={MLP['num_samples']}",
         f"data.input_shape={json.dumps(MLP['input_shape'])}", f"data.batch_size={MLP['batch']}"],
        ["--model", "mlp", "--hidden", json.dumps(MLP["hidden"]), "--data", "synthetic",
         "--num-samples", str(MLP["num_samples"]), "--input-shape",
         json.dumps(MLP["input_shape"]), "--batch", str(MLP["batch"])]),
    # (Validation batches of 64 like the training ones: the plain loop does not validate, and a
    # larger validation batch would be a peak of memory that it never has.)
    "ResNet [16, 32, 64], synthetic [3, 32, 32], batch 64": (
        RESNET_STEPS,
        ["model=resnet", "data=synthetic", "data.input_shape=[3,32,32]",
         "data.val_batch_size=64"],
        ["--model", "resnet", "--data", "synthetic", "--input-shape", "[3, 32, 32]"]),
}


def steps_section(tmp: Path, repeats: int) -> str:
    """(a) digits CNN at batch 64, (b) an MLP on synthetic data at batch 512: the app's loop
    (default logging, progress and checkpoint settings) against bench/plain_loop.py."""
    rows = []
    for name, (steps, app_args, plain_args) in CASES.items():
        apps, plains, same = step_overhead.compare(
            [*app_args, f"trainer.max_steps={steps}"], [*plain_args, "--steps", str(steps)],
            repeats + 2, tmp)  # rounds are cheap here: no process start-up
        a, p = Stat(apps), Stat(plains)
        ratio = paired_ratio(a, p)
        rows.append(f"| {name} | {p.fmt(1e3)} | {a.fmt(1e3)} | {ratio_range(a, p)} | "
                    f"{verdict(ratio, 1.03)} | {'identical' if same else '**differ**'} |")
    # The loop's own work per step, where a step costs next to nothing (a fraction of a
    # millisecond): what a small model's step on a fast GPU shows of it. No target: the plain
    # loop logs, validates and checkpoints nothing.
    steps = 1000
    apps, plains, same = step_overhead.compare(
        ["model=mlp", "model.hidden=[8]", "data.batch_size=4", f"trainer.max_steps={steps}"],
        ["--model", "mlp", "--hidden", "[8]", "--batch", "4", "--steps", str(steps)],
        repeats + 2, tmp)
    a, p = Stat(apps), Stat(plains)
    rows.append(f"| the loop's own work: MLP [8], digits, batch 4 | {p.fmt(1e3, 3)} | "
                f"{a.fmt(1e3, 3)} | {ratio_range(a, p)} | +{(a.median - p.median) * 1e6:.0f} µs "
                f"a step (no target) | {'identical' if same else '**differ**'} |")
    first = next(iter(CASES.values()))
    w, wo = step_overhead.callback_cost([*first[1], f"trainer.max_steps={first[0] // 2}"],
                                        repeats, tmp)
    w, wo = Stat(w), Stat(wo)
    rows.append(f"| CNN: three no-op callbacks (every hook) against none | {wo.fmt(1e3)} | "
                f"{w.fmt(1e3)} | {ratio_range(w, wo)} | {verdict(paired_ratio(w, wo), 1.01)} "
                f"(target 1.01) | |")
    w, wo = step_overhead.overrides_cost([*first[1], f"trainer.max_steps={first[0] // 2}"],
                                         ["trainer.telemetry=true"], repeats, tmp, "telemetry")
    w, wo = Stat(w), Stat(wo)
    rows.append(f"| CNN: trainer.telemetry=true (step parts, speed, FLOPs, memory) against off "
                f"| {wo.fmt(1e3)} | {w.fmt(1e3)} | {ratio_range(w, wo)} | "
                f"{verdict(paired_ratio(w, wo), 1.02)} (target 1.02) | |")
    # The profiler's window (bench/step_overhead.window_cost): steps 31-37 traced of 60.
    window = step_overhead.window_cost(
        [*first[1], "trainer.max_steps=60"],
        ["+callbacks/profiler=default", "callbacks.profiler.wait=30",
         "callbacks.profiler.warmup=2", "callbacks.profiler.active=5"], range(31, 38),
        repeats, tmp)
    inside, outside = (statistics.median(window[k]) for k in ("inside", "outside"))
    rows.append(f"| CNN: +callbacks/profiler=default, the steps of its window (31-36 of 60) "
                f"against none | | | {inside:.3f} | (no target; the window's last step adds "
                f"{statistics.median(window['last_s']):.2f} s: the trace written) | |")
    rows.append(f"| CNN: the same, the steps outside its window | | | {outside:.3f} | "
                f"{verdict(outside, 1.01)} (target 1.01) | |")
    dispatch = step_overhead.dispatch_seconds()
    rows.append(f"| CNN: the same three callbacks' calls alone, timed directly | {wo.fmt(1e3)} "
                f"| +{dispatch * 1e6:.2f} µs | {1 + dispatch / wo.median:.5f} | "
                f"{verdict(1 + dispatch / wo.median, 1.01)} (target 1.01) | |")
    a, b = step_overhead.control([*first[2], "--steps", str(first[0])], repeats)
    a, b = Stat(a), Stat(b)
    rows.append(f"| control: the plain loop against itself (CNN) | {b.fmt(1e3)} | {a.fmt(1e3)} "
                f"| {ratio_range(a, b)} | | |")
    return ("| case | plain loop ms/step | app ms/step | ratio | target 1.03 | losses |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows))


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
    """devices=2 against devices=1 (one thread per process), and the same for a plain DDP loop
    under torchrun: what PyTorch's DDP costs on this machine without the app."""
    one_thread = {"OMP_NUM_THREADS": "1"}
    app = [f"trainer.max_steps={DDP_STEPS}", "distributed.omp_threads=1"]
    runs: dict[str, list] = {"app1": [], "app2": [], "plain1": [], "plain2": [], "spawn": []}
    for r in range(repeats):
        for n in (1, 2):
            runs[f"app{n}"].append(run_probed(
                app_cmd(*app, f"devices={n}", f"hydra.run.dir={tmp / f'ddp{n}-{r}'}"),
                DDP_STEPS, REPO, env=one_thread))
            runs[f"plain{n}"].append(run_probed(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={n}", str(BENCH / "plain_loop.py"), "--steps",
                 str(DDP_STEPS)], DDP_STEPS, REPO, env=one_thread))
    for r in range(1):  # spawn only for comparison: one run
        runs["spawn"].append(run_probed(
            app_cmd(*app, "devices=2", "distributed.start_method=spawn",
                    f"hydra.run.dir={tmp / f'spawn-{r}'}"), DDP_STEPS, REPO, env=one_thread))
    step = {k: Stat([x.step_s for x in v]) for k, v in runs.items()}
    first = {k: Stat([x.first_step_s for x in v]) for k, v in runs.items()}
    ddp_ratio = paired_ratio(step["app2"], step["app1"])
    extra = first["app2"].median - first["app1"].median
    return f"""### DDP overhead (weak scaling, gloo, 1 thread per process, batch 64 per process)

Bucket size 25 MB (`distributed.bucket_cap_mb`, DDP's default): the CNN's gradients (0.4 MB)
fill one bucket, so its all-reduce starts when backward ends: no overlap with backward here.

| ms per step (rank 0) | devices=1 | devices=2 | ratio | target 1.15 |
|---|---|---|---|---|
| app | {step['app1'].fmt(1e3)} | {step['app2'].fmt(1e3)} \
| {ratio_range(step['app2'], step['app1'])} | {verdict(ddp_ratio, 1.15)} |
| plain loop, plain DDP (torchrun) | {step['plain1'].fmt(1e3)} | {step['plain2'].fmt(1e3)} \
| {ratio_range(step['plain2'], step['plain1'])} | |

### Spawn cost (time to first step, seconds)

| devices=1 | devices=2, forkserver (default) | devices=2, spawn | extra (forkserver) | target 1.0 |
|---|---|---|---|---|
| {first['app1'].fmt()} | {first['app2'].fmt()} | {first['spawn'].fmt()} | {extra:.2f} \
| {verdict(extra, 1.0)} |"""


def checkpoint_stall(tmp: Path, repeats: int) -> str:
    micro = ckpt_stall.measure(repeats)
    size = micro["size_mb"][0]
    plain = Stat(micro["plain"])
    waits: dict[str, list[float]] = {"true": [], "false": []}
    stalls: dict[str, list[float]] = {"true": [], "false": []}
    for r in range(max(1, repeats - 1)):
        for mode in ("true", "false"):
            run_dir = tmp / f"ckpt-{mode}-{r}"
            run = run_probed(app_cmd(*ckpt_stall.LOOP_OVERRIDES, f"trainer.async_checkpoint={mode}",
                                     f"hydra.run.dir={run_dir}"), ckpt_stall.LOOP_STEPS, REPO)
            waits[mode].append(ckpt_stall.loop_wait(run_dir))
            stalls[mode] += ckpt_stall.stalls(run.times)
    a = Stat(waits["true"])
    ratio = a.median / plain.median
    rows = [
        ("`torch.save` of the state, in the caller's thread (baseline)", plain),
        ("app's synchronous atomic save (temp file, fsync, rename)", Stat(micro["sync"])),
        ("app's asynchronous save: the caller blocked, copying all of the state itself",
         Stat(micro["blocked"])),
        ("app's asynchronous save: until the file is on disk", Stat(micro["write"])),
        ("loop waited per checkpoint, trainer.async_checkpoint=false", Stat(waits["false"])),
        ("loop waited per checkpoint, trainer.async_checkpoint=true", a),
        ("cross-check from step times: stall, async_checkpoint=false", Stat(stalls["false"])),
        ("cross-check from step times: stall, async_checkpoint=true", Stat(stalls["true"])),
    ]
    table = "\n".join(f"| {name} | {stat.fmt(digits=3)} |" for name, stat in rows)
    return f"""State of {size:.0f} MB (an MLP's weights; SGD, so no optimizer state), seconds:

| | seconds |
|---|---|
{table}
| async wait / `torch.save` (target 0.20) | {ratio:.3f}: {verdict(ratio, 0.20)} |

"Loop waited" is what the run itself measures and logs at its end (time in the save call,
plus any wait of the next update for the background copy), in a real run with a checkpoint
every {ckpt_stall.LOOP_EVERY} steps: `python -m app {' '.join(ckpt_stall.LOOP_OVERRIDES)}`.
Training there uses one of the two cores, so that the writer thread has one of its own; with
both cores training, the write slows the steps it overlaps instead. The cross-check is each
step after a checkpoint minus the median step (noisier: single steps)."""


def memory(tmp: Path, repeats: int) -> str:
    """Peak resident memory of whole runs (processes), app and plain loop alternating; the
    plain loop draws its loss curve with matplotlib at its end, as app draws its curves."""
    rows = []
    for i, (name, (steps, app_args, plain_args)) in enumerate(CASES.items()):
        apps, plains = [], []
        for r in range(max(1, repeats - 1)):  # memory hardly varies between runs
            apps.append(run_probed(app_cmd(*app_args, f"trainer.max_steps={steps}",
                                           f"hydra.run.dir={tmp / f'mem{i}-{r}'}"), steps, REPO))
            plains.append(run_probed(plain_cmd(*plain_args, "--steps", str(steps), "--plot",
                                               str(tmp / f"plain{i}-{r}.png")), steps, REPO))
        a, p = Stat([x.peak_rss_mb for x in apps]), Stat([x.peak_rss_mb for x in plains])
        ratio = paired_ratio(a, p)
        rows.append(f"| {name} | {p.fmt(digits=0, unit=' MB')} | {a.fmt(digits=0, unit=' MB')} "
                    f"| {ratio_range(a, p)} | {verdict(ratio, 1.10)} |")
    return ("| run | plain loop peak RSS | app peak RSS | ratio | target 1.10 |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows))


def blas_section(tmp: Path, repeats: int) -> str:
    return blas_mode.section(repeats)


def loader_section(tmp: Path, repeats: int) -> str:
    return image_loader.section(repeats)


def fsdp_section(tmp: Path, repeats: int) -> str:
    return fsdp.section(tmp, repeats, REPO)


def compile_section(tmp: Path, repeats: int) -> str:
    return compile_cache.section(repeats, tmp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = p.parse_args()
    started = time.time()
    sections = {}
    with tempfile.TemporaryDirectory(prefix="app-bench-") as tmp:
        tmp = Path(tmp)
        for name, fn in (("steps", steps_section), ("startup", startup), ("memory", memory),
                         ("ddp", ddp_and_spawn), ("checkpoint", checkpoint_stall),
                         ("blas", blas_section), ("loader", loader_section),
                         ("fsdp", fsdp_section), ("compile", compile_section)):
            sections[name] = fn(tmp, args.repeats)
            print(sections[name], flush=True)
    took = time.time() - started
    args.out.write_text(render(sections, args.repeats, took))
    print(f"wrote {args.out} in {took:.0f} s")


def render(s: dict[str, str], repeats: int, took: float) -> str:
    return f"""# Benchmarks

Written by `make bench` (bench/run.py) on {time.strftime('%Y-%m-%d %H:%M')}, in {took:.0f} s.
Machine: {machine()}.

Each figure: median of {repeats} runs, (min-max) in brackets; app and baseline runs
alternate. Ratios are app / baseline: the median of the ratios of paired runs (run side by
side), with their range.
Timing on this machine is noisy; read the ratios, not the absolute times.

## 1. Step overhead against a plain PyTorch loop

bench/plain_loop.py trains the same model and data classes with the same batch, optimizer
(AdamW, no decay on 1-d parameters), schedule, seed and thread count; the app runs with its
default logging, progress and checkpoint settings (validation and checkpoint each epoch, the
loss logged every 10 steps, to a log file). Both loops run in one process and take turns,
one optimizer step each (bench/step_overhead.py: each loop in a thread of its own, who goes
first alternating), so that they share imports, thread pools and allocator state, and the
machine's drifts (tens of percent over seconds here) hit both alike. Median time per step
after 10 warm-up steps, {repeats + 2} rounds. The control row runs the plain loop against
itself the same way: its ratio shows the resolution of the method. "The loop's own work"
is a model whose step costs a fraction of a millisecond, so the difference in µs is the app's
own per-step work (the loss check, logging every 10th step, the stop agreement, the sampler):
what shows of it on a fast GPU, where a small model's step is mostly host work. "losses":
the losses the app logged equal the plain loop's at the same steps, bit for bit (each loop
run alone). The telemetry row runs the app with `trainer.telemetry=true` against itself
without it, in turns; the profiler rows the same with `+callbacks/profiler=default` tracing
steps 31-37 of 60, split into the steps of its window (their median, the last step aside)
and the steps outside it.

{s['steps']}

## 2. Time to first step

{s['startup']}

## 3. and 5. Spawn cost and DDP overhead

{s['ddp']}

## 4. Checkpoint stall

{s['checkpoint']}

## 6. Memory

Peak resident memory (VmHWM, recorded by the probe at exit) of whole runs as processes:
`python -m app` with the case's settings against `python bench/plain_loop.py`, alternating.
Both draw their curves with matplotlib at the end (app: `plots/curves.png`; the plain loop:
`--plot`): importing matplotlib costs some 30 MB once, whatever the model.

{s['memory']}

## 7. MKL's strict reproducibility mode

`python -m app` sets MKL_CBWR=AUTO,STRICT (unless it is set): MKL's matrix products then give
the same bits on any thread count, so a run resumed on other cores continues bit for bit
(tests/test_resume.py). The mode is per process, so bench/blas_mode.py runs the plain loop
as processes, in MKL's default mode and in strict mode alternately, with the same thread
count. Median time per step after 10 warm-up steps.

{s['blas']}

## 8. Image loading: `data=image_folder` against a plain DataLoader

bench/image_loader.py: the loader the app's loop builds over an image folder against a plain
PyTorch DataLoader over the same files with the same decoding and transforms (Pillow, the
random resized crop and flip, normalisation), app and plain alternating; with the app's
cache on, the app decodes each image once and the plain loader still decodes every time.

{s['loader']}

## 9. FSDP against DDP

bench/fsdp.py: `distributed.strategy=fsdp` against `ddp`, 2 ranks on this machine's CPU.

{s['fsdp']}

## 10. Compile cache: the first compile against the second

bench/compile_cache.py: `compile=true` on the default job, first into an empty cache, then
resumed from its checkpoint as a requeued job is, compiling from the run directory's
`compile_cache/`; then resumed again with inductor's folder deleted, from the portable cache
artifacts alone (inductor's graphs come back from them, but on a CPU its C++ kernels are
built again, which is most of a compile). Compile seconds as the run logs them; first step: process
start to the end of the first optimizer step.

{s['compile']}

## Reading the misses

- Time to first step: PyTorch imports `torch._dynamo` the first time any optimizer is used
  (`Optimizer.add_param_group` is wrapped by `torch._disable_dynamo`, and every
  `Optimizer.step` imports it), which costs about as much as importing torch; the floor
  `import torch, hydra` leaves it out, the plain loop pays it too. The app's own share is
  Hydra's: its import, two composes (`hydra.main` composes once to read the run mode and once
  for the run) and the job set-up (see the breakdown).
- DDP: the plain DDP row is PyTorch's DDP without the app, on the same machine; two
  processes on two cores share them with gloo's threads, and a gloo all-reduce over the
  loopback costs about a millisecond here.
- Step overhead: read the ratio against the control row, whose spread is the resolution.
"""


if __name__ == "__main__":
    main()
