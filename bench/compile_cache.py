"""The first compile against the second: `compile=true` on the default job (CNN, digits),
into an empty cache (cold), then the same run resumed from its checkpoint, as a requeued job
is, compiling from its run directory's `compile_cache/` (warm); and once more with inductor's
folder deleted, from the portable cache artifacts alone.

Compile seconds are the run's own log line (`compile: X s, cache hits H, misses M`); first
step is process start to the end of its first optimizer step (the probe), which holds the
compile. Each resumed run trains STEPS more steps.

    python bench/compile_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path

from common import BENCH, Stat, app_cmd, machine, paired_ratio, ratio_range, run_probed

REPO = BENCH.parent
STEPS = 5
LINE = re.compile(r"compile: ([\d.]+) s, cache hits (\d+), misses (\d+)")
KINDS = ("cold", "warm", "artifacts")


def _compiled(run_dir: Path, steps: int) -> tuple[float, float, int]:
    """One run of the default job, compile=true, to `steps` steps (a resume when run_dir
    holds a checkpoint): first-step seconds, compile seconds and cache hits of that run."""
    run = run_probed(app_cmd("compile=true", f"trainer.max_steps={steps}",
                             "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"),
                     STEPS, REPO)
    seconds, hits, _ = LINE.findall((run_dir / "train.log").read_text())[-1]
    return run.first_step_s, float(seconds), int(hits)


def measure(repeats: int, tmp: Path) -> dict[str, dict[str, list[float]]]:
    # inductor's own cache must not serve the cold run: the runs choose their folder
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out: dict[str, dict[str, list[float]]] = {k: {"first": [], "compile": [], "hits": []}
                                              for k in KINDS}
    for r in range(repeats):
        run_dir = tmp / f"compiled-{r}"
        for i, kind in enumerate(KINDS):
            if kind == "artifacts":
                shutil.rmtree(run_dir / "compile_cache" / "inductor")
            first, seconds, hits = _compiled(run_dir, STEPS * (i + 1))
            for key, value in (("first", first), ("compile", seconds), ("hits", hits)):
                out[kind][key].append(value)
    return out


def section(repeats: int, tmp: Path) -> str:
    m = measure(repeats, tmp)
    rows = []
    for kind, name in (("warm", "resumed: from the run's cache"),
                       ("artifacts", "resumed: from the artifacts alone (inductor's folder gone)")):
        rows.append(f"| {name} | {Stat(m[kind]['compile']).fmt()} | "
                    f"{ratio_range(Stat(m[kind]['compile']), Stat(m['cold']['compile']))} | "
                    f"{Stat(m[kind]['first']).fmt()} | "
                    f"{paired_ratio(Stat(m[kind]['first']), Stat(m['cold']['first'])):.3f} | "
                    f"{int(min(m[kind]['hits']))} |")
    cold = m["cold"]
    return ("| run (compile=true, default job) | compile s | ratio to cold | first step s | "
            "ratio to cold | cache hits |\n|---|---|---|---|---|---|\n"
            f"| first: an empty cache (cold) | {Stat(cold['compile']).fmt()} | 1 | "
            f"{Stat(cold['first']).fmt()} | 1 | {int(max(cold['hits']))} |\n" + "\n".join(rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"Machine: {machine()}\n")
    with tempfile.TemporaryDirectory(prefix="app-bench-") as tmp:
        print(section(args.repeats, Path(tmp)))
