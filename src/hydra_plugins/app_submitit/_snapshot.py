"""The code snapshot of a Slurm submission, so that editing the working tree never changes a
queued job nor its requeues: every folder the jobs import from, copied into the sweep
directory and first on their PYTHONPATH (PYTHONSAFEPATH=1 keeps the working directory off
sys.path). Not submitit's RsyncSnapshot: it copies one git repository's tracked files only
(a module not yet added would be missing) and needs rsync."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import log, refuse

FOLDER = ".code"  # in the sweep directory: one numbered snapshot per submission


@dataclass
class Snapshot:
    where: Path
    paths: list[str]  # the import folders in the copy, in the order they are searched

    def setup_lines(self) -> list[str]:
        """sbatch lines before srun, whose tasks inherit them."""
        joined = os.pathsep.join(self.paths)
        return [f'export PYTHONPATH="{joined}${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}}"',
                "export PYTHONSAFEPATH=1"]


def files_of(root: Path) -> list[Path]:
    """The files git tracks or does not ignore (else the `.py` files), relative to `root`."""
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
    """A virtualenv or conda environment (the jobs run in theirs; often gigabytes)."""
    return (folder / "pyvenv.cfg").is_file() or (folder / "conda-meta").is_dir()


def take(sweep_dir: Path, max_mb: float) -> Snapshot:
    """Copy the import folders (the working directory, PYTHONPATH, app's source outside
    site-packages, in order) into sweep_dir/.code/N (N: one more per submission)."""
    import app

    source = Path(app.__file__).resolve().parents[1]
    roots = [Path.cwd(), *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p)]
    if not {"site-packages", "dist-packages"} & set(source.parts):
        roots.append(source)
    roots = [root for root in dict.fromkeys(r.resolve() for r in roots) if root.is_dir()]
    # A folder inside another one is found in that one's copy (the working directory and
    # its src/, say): copied once.
    copied = [r for r in roots if not any(o != r and o in r.parents for o in roots)]
    plan = {root: files_of(root) for root in copied}
    size = sum((root / f).stat().st_size for root, files in plan.items() for f in files)
    if size > max_mb * 1e6:
        refuse("the code snapshot would copy %.1f MB (%s), over hydra.launcher.snapshot_max_mb="
               "%g: raise it, or submit without a snapshot (hydra.launcher.code_snapshot=false)",
               size / 1e6, ", ".join(map(str, copied)), max_mb)
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
    log.info("code snapshot: %d files (%.1f MB) in %s; the jobs and their requeues import "
             "from it", sum(map(len, plan.values())), size / 1e6, where)
    return Snapshot(where, paths)
