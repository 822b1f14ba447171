"""A non-editable install runs from any folder: conf/ ships inside the wheel.

The project is installed into a fresh virtualenv that borrows torch & co from the system; the
system's editable `app` is behind it on sys.path, so the test checks which copy was imported.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

# What a build reads: the wheel is built from a copy, so the checkout gains no build/ folder.
SOURCES = ["pyproject.toml", "setup.py", "README.md", "src", "conf"]


def _venv_python(tmp_path: Path) -> Path:
    """A virtualenv with the project installed from a copy of its sources (no network)."""
    tree = tmp_path / "tree"
    for name in SOURCES:
        src, dst = REPO / name, tree / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    venv = tmp_path / "venv"
    # No pip of its own: the system's pip, seen through --system-site-packages, installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", str(tree)], check=True, cwd=tmp_path)
    return python


def test_installed_wheel_runs_from_another_folder(tmp_path):
    python = _venv_python(tmp_path)
    where = tmp_path / "elsewhere"
    where.mkdir()
    # -P: the working folder is not put on sys.path.
    found = subprocess.run(
        [str(python), "-P", "-c", "import app.conf_dir as m; print(m.__file__, m.config_dir())"],
        cwd=where, capture_output=True, text=True, check=True).stdout.split()
    module, conf = map(Path, found)
    assert module.is_relative_to(tmp_path / "venv"), f"imported {module}, not the installed copy"
    assert conf == module.parent / "conf" and (conf / "debug" / "fast.yaml").is_file()

    run = subprocess.run(
        [str(python), "-P", "-m", "app", "debug=fast", "trainer.progress_bar=false",
         f"hydra.run.dir={where / 'run'}"],
        cwd=where, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert list((where / "run").rglob("*.pt")), "the run left no checkpoint"
