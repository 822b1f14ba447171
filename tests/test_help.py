"""`python -m app --help`: its list of config groups (app.help) holds the options of the folders
given as `hydra.searchpath=[...]` on the same command line, as Hydra's $APP_CONFIG_GROUPS does
not; without one, the list is Hydra's."""

from __future__ import annotations

import subprocess
import sys

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from app.help import config_groups
from conftest import CONF_DIR, REPO


def test_help_lists_the_options_of_the_searchpath(tmp_path) -> None:
    for option in ("model/mine.yaml", "mygroup/deeper/one.yaml"):
        (tmp_path / option).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / option).write_text("a: 1\n")
    shown = subprocess.run(
        [sys.executable, "-m", "app", "--help", f"hydra.searchpath=[file://{tmp_path}]"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "model: cnn, mine, mlp, resnet, timm, torchvision" in lines, shown.stdout
    assert "mygroup/deeper: one" in lines and "trainer: eval, export, predict, trainval" in lines


def test_without_a_searchpath_the_groups_are_hydras() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        assert config_groups([]) == hydra.format_config_groups(
            lambda group: group != "hydra" and not group.startswith("hydra/"))
