"""Packaging that pyproject.toml cannot say: conf/ ships inside the wheel as `app/conf` (and
the reference of every key, docs/reference.md, as `app/docs/reference.md`).

conf/ stays at the top of the repository (its one source); the mapping below copies it into
the wheel, so an installed `app` composes from `app/conf` (see app/conf_dir.py).
"""

from setuptools import find_namespace_packages, setup

setup(
    package_dir={"": "src", "app.conf": "conf", "app.docs": "docs"},
    packages=[
        *find_namespace_packages("src", include=["app*", "hydra_plugins*"],
                                 exclude=["*__pycache__"]),
        "app.conf",
        "app.docs",
    ],
    # docs/reference.md too: `python -m app --help` points to it, in a wheel as well.
    package_data={"app.conf": ["**/*.yaml"], "app.docs": ["reference.md"]},
)
