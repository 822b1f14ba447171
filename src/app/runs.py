"""`python -m app.runs`: find, inspect and compare the runs under an output folder.

  ls [DIR] [KEY=VALUE ...] [--status S]   the runs under DIR (outputs/), newest first
  show RUN                                one run: overrides, the command that runs it
                                          again, what differs from the defaults, its
                                          result and its files
  diff RUN_A RUN_B                        the config keys that differ; both runs' metrics

--json (after the command) prints one JSON document instead: docs/json.md names its fields.

A run is any directory with a `.hydra/config.yaml` (a sweep's jobs too); everything is read
from the directories, so runs of any launcher, finished or not, are listed alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from contextlib import suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from app.errors import first_line
from app.flat import leaves
from app.reporting.results import JSON_HELP, RESULT, emit, folder_arg, read_metrics
from app.rundir.name import is_job_of_sweep
from app.sweeps.summary import job_summary, overrides_of

# Folders that hold no run (walked past), and torch.compile's cache (many small files: one
# line in `show`, not each of them).
SKIP = {".code", ".submitit", "checkpoints", "logs", "plots", ".hydra", "export", "compile_cache"}


def describe(run: Path) -> dict[str, Any]:
    summary = job_summary(run)
    saved = run / ".hydra" / "config.yaml"
    config = OmegaConf.load(saved)
    try:  # the run's option of each config group (Hydra's runtime.choices)
        hydra = OmegaConf.load(run / ".hydra" / "hydra.yaml")
    except (OSError, ValueError):
        hydra = OmegaConf.create()
    choices = OmegaConf.select(hydra, "hydra.runtime.choices", default=None)
    overrides = overrides_of(run)
    return {**summary, "run": run, "config": config,
            "choices": dict(OmegaConf.to_container(choices)) if choices is not None else {},
            "monitor_mode": summary["mode"],  # ("mode" is the run's: trainval, eval ...)
            "mode": OmegaConf.select(config, "trainer.mode", default=None),
            "started": saved.stat().st_mtime,  # (Hydra writes the config first)
            "overrides": overrides, "command": " ".join(overrides)}


def fields(r: dict[str, Any]) -> dict[str, Any]:
    """A described run as --json gives it (`ls`; `show` and `diff` add to it)."""
    started = datetime.fromtimestamp(r["started"]).astimezone().isoformat(timespec="seconds")
    return {"run": str(r["run"]), "started": started,
            **{k: r[k] for k in ("status", "error", "mode", "monitor", "monitor_mode", "best",
                                 "final", "steps", "wall_s", "attempts", "slowest_rank",
                                 "overrides")}}


def rerun_command(run: Path) -> str:
    """The command that runs it again in its own directory (resume=auto continues it): its
overrides and Hydra's (a search path of your own, a launcher) as typed, a sweep's for a job."""
    sweep = run.parent / "multirun.yaml"
    saved = sweep if is_job_of_sweep(run) and sweep.is_file() else run / ".hydra" / "hydra.yaml"
    try:
        given = OmegaConf.load(saved).hydra.overrides
    except Exception:  # (an unreadable or partial record): the task's overrides alone
        given = OmegaConf.create({"hydra": [], "task": overrides_of(run)})
    where = f"hydra.sweep.dir={run.parent}" if saved == sweep else f"hydra.run.dir={run}"
    words = [str(o) for o in [*given.task, *given.hydra]
             if not str(o).startswith(("hydra.run.dir=", "hydra.sweep.dir=", "hydra.mode="))]
    return shlex.join(["python", "-m", "app", *(["-m"] if saved == sweep else []), *words,
                       where])


_MISSING = object()


def value_of(run: dict[str, Any], key: str) -> Any:
    """The run's value of a config key, or its choice of a group (`model` -> `mlp`)."""
    key = key.lstrip("+")
    if "." not in key and key in run["choices"]:
        return run["choices"][key]
    have = OmegaConf.select(run["config"], key, default=_MISSING)
    return OmegaConf.to_container(have) if isinstance(have, (DictConfig, ListConfig)) else have


def _same(have: Any, value: str) -> bool:
    """Whether a config value (_MISSING: never) is VALUE as YAML reads it."""
    if have == yaml.safe_load(value) or str(have) == value:
        return True
    with suppress(TypeError, ValueError):  # numbers as numbers: 1e-3 is 0.001
        return float(have) == float(value)
    return False


def matches(run: dict[str, Any], wanted: list[str]) -> bool:
    """Whether the run's config has each KEY=VALUE."""
    return all(_same(value_of(run, key), value)
               for key, _, value in (item.partition("=") for item in wanted))


def _order(run: dict[str, Any]) -> tuple:
    """Newest first; a sweep's jobs together, by number."""
    folder = run["run"]
    sweep = folder.parent / "multirun.yaml"
    began = sweep.stat().st_mtime if sweep.is_file() else run["started"]
    return (-began, str(folder.parent), int(folder.name) if folder.name.isdigit() else 0,
            folder.name)


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, str):  # (a cell of metrics.csv, or a word such as a status)
        with suppress(ValueError):
            value = float(value)
    if value is None or value == "":
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def cmd_ls(root: Path, wanted: list[str], status: str | None, as_json: bool = False) -> int:
    if not root.is_dir():
        print(f"error: {root}: no such folder", file=sys.stderr)
        return 2
    every = []  # the runs under root (itself included)
    for folder, subfolders, _ in os.walk(root, followlinks=True):
        subfolders[:] = [name for name in subfolders if name not in SKIP]
        if (Path(folder) / ".hydra" / "config.yaml").is_file():
            try:
                every.append(describe(Path(folder)))
            except Exception as e:  # (one broken run folder must not hide the others)
                print(f"warning: {folder}: skipped: {_unreadable(e)}", file=sys.stderr)
    runs = [r for r in every if matches(r, wanted) and (status is None or
                                                        r["status"].startswith(status))]
    runs.sort(key=_order)
    if as_json:
        emit([fields(r) for r in runs])
    out = sys.stderr if as_json else sys.stdout  # (--json: stdout holds the document alone)
    if not runs:
        print(f"no runs under {root}" + (" that match" if wanted or status else ""), file=out)
        # What in the filters no run has: a misspelt key reads otherwise as "no such runs".
        for key in [item.partition("=")[0] for item in wanted] if every else []:
            if all(value_of(r, key) is _MISSING for r in every):
                print(f"  {key}: no run here has this key", file=out)
        statuses = sorted({r["status"] for r in every})
        if every and status is not None and not any(s.startswith(status) for s in statuses):
            print(f"  --status {status}: the runs here are {', '.join(statuses)}", file=out)
        return 0
    if as_json:
        return 0
    rows = [["run", "status", "mode", "best", "steps", "wall_s", "started", "command"]]
    for r in runs:
        best = f"{r['monitor']} {_number(r['best'])}" if r["best"] is not None else "-"
        rows.append([str(r["run"].relative_to(root)) if r["run"] != root else ".",
                     r["status"], str(r["mode"] or "?"), best, _number(r["steps"]),
                     _number(r["wall_s"], 1),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(r["started"])),
                     r["command"] or "(defaults)"])
    print(table(rows))
    print(f"{len(runs)} run(s)")
    return 0


def differences(a: DictConfig, b: DictConfig) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for each key whose value differs (_MISSING where one
    config lacks the key: "-" in the text, null in JSON)."""
    la, lb = leaves(a), leaves(b)
    return [(k, la.get(k, _MISSING), lb.get(k, _MISSING)) for k in sorted(set(la) | set(lb))
            if la.get(k, _MISSING) != lb.get(k, _MISSING)]


def _unreadable(e: Exception) -> str:
    return f"its .hydra/config.yaml does not load as a config ({first_line(e)})"


def _described(path: Path) -> dict[str, Any] | None:
    """`describe(path)`, or None with the reason on stderr."""
    if not (path / ".hydra" / "config.yaml").is_file():
        print(f"error: {path}: not a run directory (no .hydra/config.yaml)", file=sys.stderr)
        return None
    try:
        return describe(path)
    except Exception as e:
        print(f"error: {path}: {_unreadable(e)}", file=sys.stderr)
        return None


def shown(run: Path, r: dict[str, Any]) -> dict[str, Any]:
    """What `show` says of a described run (the text and --json alike)."""
    from hydra import compose, initialize_config_dir

    from app.conf_dir import config_dir
    from app.config import register_schemas

    register_schemas()  # (no resolver: the config is compared unresolved)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        defaults = compose("config")  # as `python -m app` composes it (its hydra node left out)
    records, unreadable = {}, {}  # eval.json and result.json: read, or why not
    for name in ("eval.json", RESULT):
        if (run / name).is_file():
            try:
                records[name] = json.loads((run / name).read_bytes())
            except ValueError as e:
                unreadable[name] = f"not valid JSON ({e})"
    files = {str(p.relative_to(run)): p.stat().st_size for p in sorted(run.rglob("*"))
             if p.is_file() and not any(part.startswith(".") or part == "compile_cache"
                                        for part in p.relative_to(run).parts)}
    if (run / "compile_cache").is_dir():
        files["compile_cache/"] = sum(p.stat().st_size for p in
                                      (run / "compile_cache").rglob("*") if p.is_file())
    return {**fields(r), "command": rerun_command(run), "choices": r["choices"],
            "differs_from_defaults": [
                {"key": key, "value": value, "default": default}
                for key, default, value in differences(defaults, r["config"])],
            "eval": records.get("eval.json"), "result": records.get(RESULT),
            "unreadable": unreadable,
            "files": [{"path": path, "bytes": size} for path, size in files.items()]}


def _given(value: Any) -> Any:
    return "-" if value is _MISSING else value


def _nulls(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A key one config lacks as JSON's null (the text's "-")."""
    return [{k: None if v is _MISSING else v for k, v in row.items()} for row in rows]


def cmd_show(run: Path, as_json: bool = False) -> int:
    r = _described(run)
    if r is None:
        return 2
    s = shown(run, r)
    if as_json:
        emit({**s, "differs_from_defaults": _nulls(s["differs_from_defaults"])})
        return 0
    print(f"run {run}")
    print(f"status: {r['status']}" + (f" ({r['error']})" if r["error"] else ""))
    print(f"mode: {r['mode'] or '?'}; best {r['monitor']}: {_number(r['best'])}; steps: "
          f"{_number(r['steps'])}; wall_s: {_number(r['wall_s'], 1)}")
    print(f"overrides: {r['command'] or '(none)'}")
    print(f"command: {s['command']}")
    changed = s["differs_from_defaults"]
    print("differs from the defaults:" + ("" if changed else " nothing"))
    for d in changed:
        print(f"  {d['key']}: {_given(d['value'])} (default: {_given(d['default'])})")
    for name, key in (("eval.json", "eval"), (RESULT, "result")):
        if name in s["unreadable"]:
            print(f"{name}: {s['unreadable'][name]}")
        elif s[key] is not None:
            print(f"{name}: {json.dumps(s[key])}")
    print("files:")
    for f in s["files"]:
        print(f"  {f['path']}  {tqdm.format_sizeof(f['bytes'], 'B')}")
    return 0


def _float(cell: str | None) -> float | None:
    """A cell of metrics.csv as a number (None: empty, or no such column)."""
    try:
        return float(cell)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def compared(a: Path, b: Path, ra: dict[str, Any], rb: dict[str, Any]) -> dict[str, Any]:
    """What `diff` says of two described runs (the text and --json alike)."""
    # Each validation of either run, by step: loss and accuracy of A and of B.
    va, vb = ({int(r["step"]): r for r in read_metrics(run) if r["split"] == "val"}
              for run in (a, b))
    return {"a": fields(ra), "b": fields(rb),
            "differences": [{"key": k, "a": x, "b": y}
                            for k, x, y in differences(ra["config"], rb["config"])],
            "validations": [
                {"step": step, **{f"{side}_val_{k}": _float(rows.get(step, {}).get(k))
                                  for side, rows in (("a", va), ("b", vb))
                                  for k in ("loss", "acc")}}
                for step in sorted(set(va) | set(vb))]}


def cmd_diff(a: Path, b: Path, as_json: bool = False) -> int:
    ra, rb = _described(a), _described(b)
    if ra is None or rb is None:
        return 2
    c = compared(a, b, ra, rb)
    if as_json:
        emit({**c, "differences": _nulls(c["differences"])})
        return 0
    print(f"A: {a}\nB: {b}")
    changed = c["differences"]
    rows = [["key", "A", "B"]] + [[d["key"], str(_given(d["a"])), str(_given(d["b"]))]
                                  for d in changed]
    print(table(rows) if changed else "the configs are the same")
    digits = {"status": 0, "best": 4, "steps": 0, "wall_s": 1}
    print("\n" + table([["", "A", "B"]] + [[k, _number(c["a"][k], d), _number(c["b"][k], d)]
                                           for k, d in digits.items()]))
    print("\n" + table([["step", "A val loss", "A val acc", "B val loss", "B val acc"]] + [
        [str(v["step"])] + [_number(v[f"{side}_val_{k}"]) for side in ("a", "b")
                            for k in ("loss", "acc")] for v in c["validations"]]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ls = commands.add_parser("ls", help="the runs under a folder")
    ls.add_argument("filters", nargs="*", help="DIR first (default outputs), then KEY=VALUE")
    ls.add_argument("--status", help="completed, failed, interrupted, running ...")
    show = commands.add_parser("show", help="one run")
    show.add_argument("run", type=folder_arg)
    diff = commands.add_parser("diff", help="two runs")
    diff.add_argument("run_a", type=folder_arg)
    diff.add_argument("run_b", type=folder_arg)
    for command in (ls, show, diff):
        command.add_argument("--json", action="store_true", help=JSON_HELP)
    args = parser.parse_args(argv)
    if args.command == "ls":
        root, wanted = Path("outputs"), list(args.filters)
        if wanted and "=" not in wanted[0]:
            root = Path(wanted.pop(0)).expanduser()
        bad = [w for w in wanted if "=" not in w]
        if bad:
            parser.error(f"{bad[0]}: a filter is KEY=VALUE (optimizer.lr=0.1)")
        return cmd_ls(root, wanted, args.status, args.json)
    if args.command == "show":
        return cmd_show(args.run, args.json)
    return cmd_diff(args.run_a, args.run_b, args.json)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # (`| head`: the reader has what it wanted)
        sys.stderr.close()
        sys.exit(0)
