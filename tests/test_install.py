"""A non-editable install runs from any folder: conf/ ships inside the wheel.

The project is installed into a fresh virtualenv that borrows torch & co from the environment
running the tests (a virtualenv, a conda environment or the system's Python, with or without a
user site): their site folders follow the new one's on its sys.path. The editable `app` of that
environment is among them, behind the installed copy, so the test checks which copy was
imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

from conftest import REPO

# What a build reads: the wheel is built from a copy, so the checkout gains no build/ folder.
SOURCES = ["pyproject.toml", "setup.py", "README.md", "src", "conf", "docs"]
# -P (Python 3.11+): the working folder is not put on sys.path (it is an empty one anyway).
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def _version(package: str) -> tuple[int, ...] | None:
    try:
        release = importlib.metadata.version(package).split("+")[0].split(".")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in release if part.isdigit())


def _builds_offline() -> bool:
    """Whether this environment holds a setuptools that builds wheels (pyproject.toml asks for
    64 or later; bdist_wheel is part of it from 70.1, before that it is the `wheel` package's).
    `make install` puts one in place (the dev extra); without one, pip's build isolation
    fetches it from the package index."""
    setuptools = _version("setuptools")
    return setuptools is not None and (
        setuptools >= (70, 1) or (setuptools >= (64,) and _version("wheel") is not None))


def _site_folders() -> list[str]:
    """Where this environment's packages lie: its site folders and the user's, if it reads it."""
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def _env() -> dict[str, str]:
    """This process's environment, less a PYTHONPATH entry that holds the checkout's sources
    (it would come before every installed copy)."""
    env = dict(os.environ)
    src = (REPO / "src").resolve()
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != src]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def _venv_python(tmp_path: Path) -> Path:
    """A virtualenv with the project installed from a copy of its sources."""
    tree = tmp_path / "tree"
    for name in SOURCES:
        src, dst = REPO / name, tree / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    venv = tmp_path / "venv"
    # No pip of its own and no --system-site-packages: those are the base interpreter's, which
    # need not hold torch, pip or setuptools (a virtualenv's packages are not there). This
    # environment's site folders are added after the venv's own instead (their .pth files
    # read: an editable install's finder, setuptools' distutils shim); its pip installs.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_borrowed.pth").write_text(
        "".join(f"import site; site.addsitedir({f!r})\n" for f in _site_folders()))
    # --ignore-installed: the editable app seen through those folders is left alone.
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed"]
    if _builds_offline():  # no network: this environment's setuptools builds the wheel
        install += ["--no-index", "--no-build-isolation"]
    done = subprocess.run([*install, str(tree)], cwd=tmp_path, capture_output=True, text=True,
                          env=_env(), timeout=600)
    assert done.returncode == 0, f"{' '.join(install)} failed:\n{done.stdout}{done.stderr}"
    return python


def test_installed_wheel_runs_from_another_folder(tmp_path):
    python = _venv_python(tmp_path)
    where = tmp_path / "elsewhere"
    where.mkdir()
    found = subprocess.run(
        [str(python), *SAFE_PATH, "-c",
         "import app.conf_dir as m; print(m.__file__, m.config_dir())"],
        cwd=where, capture_output=True, text=True, check=True, env=_env()).stdout.split()
    module, conf = map(Path, found)
    assert module.is_relative_to(tmp_path / "venv"), f"imported {module}, not the installed copy"
    assert conf == module.parent / "conf" and (conf / "debug" / "fast.yaml").is_file()

    run = subprocess.run(
        [str(python), *SAFE_PATH, "-m", "app", "debug=fast", "trainer.progress_bar=false",
         f"hydra.run.dir={where / 'run'}"],
        cwd=where, capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert list((where / "run").rglob("*.pt")), "the run left no checkpoint"
    # --help names the reference of every key by a path the wheel has (not the README's).
    shown = subprocess.run([str(python), *SAFE_PATH, "-m", "app", "--help"], cwd=where,
                           capture_output=True, text=True, timeout=120, env=_env()).stdout
    reference = Path(shown.rstrip().split()[-1])
    assert reference.is_relative_to(tmp_path / "venv") and reference.name == "reference.md"
    assert "trainer.max_epochs" in reference.read_text(), shown[-500:]
