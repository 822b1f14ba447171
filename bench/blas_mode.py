"""The cost of MKL's strict reproducibility mode, which `python -m app` turns on
(MKL_CBWR=AUTO,STRICT: matrix products round alike on any thread count).

The mode is per process, so the plain loop runs as processes, in MKL's default mode and in
strict mode alternately; median time per step after the warm-up. Same thread count, same work.

    python bench/blas_mode.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys

from common import BENCH, Stat, paired_ratio, ratio_range, run_probed

REPO = BENCH.parent
MODES = {"default": "AUTO", "strict": "AUTO,STRICT"}
CASES = {  # name: (steps, plain loop arguments)
    "CNN, digits, batch 64": (200, ["--model", "cnn"]),
    "MLP [1024, 1024], synthetic [3, 32, 32], batch 512": (
        40, ["--model", "mlp", "--hidden", "[1024, 1024]", "--data", "synthetic",
             "--num-samples", "16384", "--input-shape", "[3, 32, 32]", "--batch", "512"]),
    "MLP [4096], synthetic [4096], batch 16 (the kill trials' model)": (
        40, ["--model", "mlp", "--hidden", "[4096]", "--data", "synthetic",
             "--num-samples", "800", "--input-shape", "[4096]", "--batch", "16"]),
}


def section(repeats: int) -> str:
    rows = []
    for name, (steps, args) in CASES.items():
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(repeats):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))  # who goes first
            for mode in order:
                cmd = [sys.executable, str(BENCH / "plain_loop.py"), *args, "--steps", str(steps)]
                times[mode].append(run_probed(cmd, steps, REPO, env={"MKL_CBWR": MODES[mode]}
                                              ).step_s)
        strict, default = Stat(times["strict"]), Stat(times["default"])
        verdict = "met" if paired_ratio(strict, default) <= 1.03 else "**missed**"
        rows.append(f"| {name} | {default.fmt(1e3)} | {strict.fmt(1e3)} | "
                    f"{ratio_range(strict, default)} | {verdict} |")
    return ("| plain loop | MKL default ms/step | strict ms/step | ratio | target 1.03 |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    print(section(p.parse_args().repeats))
