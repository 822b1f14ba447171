"""Where `conf/` is: beside src/ for a checkout or an editable install (an edit takes effect
at once), else the copy a built wheel carries as `app/conf` (setup.py maps it in); and the
reference of every key, docs/reference.md, likewise."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _shipped(folder: str, file: str) -> Path:
    repo = _PACKAGE.parents[1] / folder  # src/app -> the repository's top
    if _PACKAGE.parent.name == "src" and (repo / file).is_file():
        return repo
    return _PACKAGE / folder


def config_dir() -> Path:
    """The folder `python -m app` composes from (it holds config.yaml)."""
    return _shipped("conf", "config.yaml")


def reference() -> str:
    """The page that explains every group and key (`python -m app --help` names it)."""
    return str(_shipped("docs", "reference.md") / "reference.md")
