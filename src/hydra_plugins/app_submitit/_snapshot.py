"""The code snapshot of a Slurm submission: the folders the jobs import from (the working
directory, each PYTHONPATH folder, app's own source when it is not in site-packages; of each,
the files git tracks or does not ignore, else its `.py` files), copied into the sweep
directory, so that editing the working tree never changes a queued job nor its requeues.
The jobs import from the copy: it goes first on PYTHONPATH, and PYTHONSAFEPATH=1 keeps the
job's working directory off sys.path. (submitit's RsyncSnapshot copies one git repository's
tracked files and needs rsync.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FOLDER = ".code"  # in the sweep directory: one numbered snapshot per submission


@dataclass
class Snapshot:
    where: Path
    paths: list[str]  # the import folders in the copy, in the order they are searched
    files: int
    size: int  # bytes

    def setup_lines(self) -> list[str]:
        """sbatch lines (before srun, whose tasks inherit them) that make the jobs import
        from the copy."""
        joined = os.pathsep.join(self.paths)
        return [f'export PYTHONPATH="{joined}${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}}"',
                "export PYTHONSAFEPATH=1"]


class TooLarge(Exception):  # noqa: N818 (reads as what happened)
    pass


def import_roots() -> list[Path]:
    """The folders this process imports user code and app from, in search order."""
    import app

    roots = [Path.cwd()] if sys.version_info >= (3, 11) else []
    roots += [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    source = Path(app.__file__).resolve().parents[1]
    if not {"site-packages", "dist-packages"} & set(source.parts):
        roots.append(source)
    return [root for root in dict.fromkeys(r.resolve() for r in roots) if root.is_dir()]


def files_of(root: Path) -> list[Path]:
    """The files to copy of an import folder, relative to it."""
    try:
        # Tracked files and new ones git does not ignore (a module not yet added is still
        # imported: missing from the copy of its package, it could not be found at all).
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached",
                                 "--others", "--exclude-standard", "--", "."],
                                capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        listed = None
    if listed is not None and listed.returncode == 0:
        files = [Path(p.decode()) for p in listed.stdout.split(b"\0") if p]
        envs = {d for d in {p for f in files for p in f.parents} if _environment(root / d)}
        return [f for f in files if not envs & set(f.parents) and (root / f).is_file()]
    found = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
                   and not _environment(Path(parent, d))]
        found += [Path(parent, n).relative_to(root) for n in names if n.endswith(".py")]
    return found


def _environment(folder: Path) -> bool:
    """A virtualenv or conda environment inside an import folder (the jobs run in theirs):
    not code to copy, and often gigabytes."""
    return (folder / "pyvenv.cfg").is_file() or (folder / "conda-meta").is_dir()


def take(sweep_dir: Path, max_mb: float) -> Snapshot:
    """Copy the import folders into sweep_dir/.code/N (N: this submission's number)."""
    roots = import_roots()
    # A folder inside another one is found in that one's copy (the working directory and
    # its src/, say): copied once.
    copied = [r for r in roots if not any(o != r and o in r.parents for o in roots)]
    plan = {root: files_of(root) for root in copied}
    size = sum((root / f).stat().st_size for root, files in plan.items() for f in files)
    if size > max_mb * 1e6:
        raise TooLarge(
            f"the code snapshot would copy {size / 1e6:.1f} MB ({', '.join(map(str, copied))}), "
            f"over hydra.launcher.snapshot_max_mb={max_mb:g}: raise it, or submit without a "
            f"snapshot (hydra.launcher.code_snapshot=false)")
    base = sweep_dir / FOLDER
    base.mkdir(parents=True, exist_ok=True)
    number = 1 + max((int(p.name) for p in base.iterdir() if p.name.isdigit()), default=0)
    where = base / str(number)
    dest = {root: where / f"{i}-{root.name or 'root'}" for i, root in enumerate(copied)}
    for root, files in plan.items():
        for name in files:
            target = dest[root] / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, target)
    outer = {root: next(o for o in copied if o == root or o in root.parents) for root in roots}
    paths = [str(dest[outer[root]] / root.relative_to(outer[root])) for root in roots]
    return Snapshot(where, paths, sum(map(len, plan.values())), size)
