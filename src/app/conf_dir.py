"""Where the config tree `conf/` is: the repository's, or the copy a wheel installs.

conf/ has one source: the top of the repository, beside src/. An editable install (and a
checkout on PYTHONPATH) reads it there, so an edit takes effect at once; a built wheel carries a
copy as `app/conf` (setup.py maps the folder into the package), which an installed `app` reads.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def config_dir() -> Path:
    """The folder `python -m app` composes from (it holds config.yaml)."""
    repo = _PACKAGE.parents[1] / "conf"  # src/app -> the repository's top
    if _PACKAGE.parent.name == "src" and (repo / "config.yaml").is_file():
        return repo
    return _PACKAGE / "conf"
