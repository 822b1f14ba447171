"""Where `conf/` is: beside src/ for a checkout or an editable install (an edit takes effect
at once), else the copy a built wheel carries as `app/conf` (setup.py maps it in)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def config_dir() -> Path:
    """The folder `python -m app` composes from (it holds config.yaml)."""
    repo = _PACKAGE.parents[1] / "conf"  # src/app -> the repository's top
    if _PACKAGE.parent.name == "src" and (repo / "config.yaml").is_file():
        return repo
    return _PACKAGE / "conf"
