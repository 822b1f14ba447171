"""Every `python -m app` command of the README composes as written, and the examples do what
the README says they do."""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO, make_config

PLACEHOLDERS = ("DAY/TIME", "PATH", "my_digits", "digits.npy")


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [re.sub(r"\s#\s.*$", "", line).strip() for block in blocks
             for line in block.splitlines()]
    return [line for line in lines if line.startswith("python -m app ")]


def _overrides(command: str) -> list[str]:
    """The overrides of `command`; of a sweep (a=1,2) the first job's."""
    words = shlex.split(command)[3:]
    if "--cfg" in words:
        del words[words.index("--cfg") + 1]  # (its argument: job, hydra or all)
    return [re.sub(r"=([^,]*),.*", r"=\1", w) if "=" in w else w
            for w in words if not w.startswith("-")]


@pytest.mark.parametrize("command", [c for c in _readme_commands()
                                     if not any(p in c for p in PLACEHOLDERS)])
def test_readme_commands_compose(command: str) -> None:
    make_config(*_overrides(command))  # raises on a key, group or value that does not exist


def test_the_step_loop_example_validates_by_steps_only() -> None:
    [command] = [c for c in _readme_commands() if "val_every_n_steps" in c]
    t = make_config(*_overrides(command)).trainer
    assert t.max_epochs is None and t.val_every_n_steps == 50
    assert t.val_every_n_epochs is None, f"{command} also validates every epoch"
