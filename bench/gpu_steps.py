"""The step ratio against a plain loop on a GPU: `python bench/gpu_steps.py [cuda
[OVERRIDES of the app's runs]]` on a CUDA machine. bench/step_overhead.py's method (the two
loops in turns, one step each) with each step's kernels waited for before it counts, for a small
model (the digits CNN at batch 64) and a medium one (the ResNet [16, 32, 64] on 3x32x32 at
batch 64). On a fast GPU a small model's step is mostly the loop's own Python work, which is
what the ratio shows. Then, per model, where the app's step goes (bench/step_parts.py: the
app's loop alone, its parts timed). Prints Markdown tables; asserts nothing on time."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import step_overhead
import step_parts
import torch
from common import Stat, paired_ratio, ratio_range

CASES = {
    "CNN, digits, batch 64": (300, [], []),
    "ResNet [16, 32, 64], synthetic [3, 32, 32], batch 64": (
        120, ["model=resnet", "data=synthetic", "data.input_shape=[3,32,32]",
              "data.val_batch_size=64"],
        ["--model", "resnet", "--data", "synthetic", "--input-shape", "[3, 32, 32]"]),
}


def main(rounds: int = 3, device: str = "cuda", extra: tuple[str, ...] = ()) -> None:
    """`extra`: overrides for the app's runs (to find what a ratio comes from)."""
    rows, parts = [], []
    with tempfile.TemporaryDirectory(prefix="app-bench-gpu-") as tmp:
        for name, (steps, app_args, plain_args) in CASES.items():
            apps, plains, same = step_overhead.compare(
                [*app_args, f"trainer.max_steps={steps}", "trainer.progress_bar=false", *extra],
                [*plain_args, "--steps", str(steps)], rounds, Path(tmp), device)
            a, p = Stat(apps), Stat(plains)
            ratio = paired_ratio(a, p)
            rows.append(f"| {name} | {p.fmt(1e3)} | {a.fmt(1e3)} | {ratio_range(a, p)} | "
                        f"{'met' if ratio <= 1.03 else '**missed**'} | "
                        f"{'identical' if same else 'differ'} |")
            measured = step_parts.measure(
                [*app_args, f"trainer.max_steps={steps}", "trainer.progress_bar=false", *extra],
                Path(tmp) / f"parts-{len(parts)}", device)
            parts.append(f"{name}:\n\n{step_parts.table(*measured)}")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU)"
    print(f"GPU: {gpu}; torch {torch.__version__}\n")
    print("| model | plain loop ms/step | app ms/step | ratio | target 1.03 | losses |\n"
          "|---|---|---|---|---|---|\n" + "\n".join(rows))
    print("\nWhere the app's step goes (its loop alone, each part between device syncs):\n")
    print("\n\n".join(parts))


if __name__ == "__main__":
    main(device=sys.argv[1] if len(sys.argv) > 1 else "cuda", extra=tuple(sys.argv[2:]))
