"""README.md and docs/*.md are true as written: every `python -m app` command composes, every
other command names something that exists (a make target, a module, a file), the examples of
your own code import, and every path, `app.` name and link the pages mention exists."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONF_DIR, REPO, make_config

# Stand-ins for the reader's own paths and hosts: such commands are composed, not validated
# (their checkpoint, folder or host does not exist here).
PLACEHOLDERS = ("DAY/TIME", "PATH", "HOST0", "my_digits", "digits.npy")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_TOOLS = {"mkdir", "touch", "cat", "printf", "kill", "sinfo", "squeue", "scancel", "sacct",
               "scontrol", "sleep", "wait", "grep", "head", "tail", "ls", "echo", "export", "cd",
               "cp", "rm", "sed", "wc", "find", "ps", "test", "true", "for", "done", "do",
               "mlflow"}  # (mlflow: its UI, from the full mlflow package; docs/training.md)


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _blocks(page: Path) -> list[str]:
    """The page's bash blocks, but those that show a refused command (`<!-- test: exit 2 -->`:
    tests/test_docs_run.py runs them)."""
    return [block for directives, block in re.findall(
        r"((?:<!-- test: .*? -->\n)*)```bash\n(.*?)```", page.read_text(), flags=re.S)
        if "<!-- test: exit" not in directives]


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and heredoc bodies left out."""
    commands, end_of_heredoc = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if end_of_heredoc is not None:
            end_of_heredoc = None if line.strip() == end_of_heredoc else end_of_heredoc
            continue
        if heredoc := re.search(r"<<\s*'?(\w+)'?", line):
            end_of_heredoc = heredoc.group(1)
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def _words(command: str) -> list[str]:
    """The command's words, comments and leading VAR=value assignments left out."""
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    # The command ends at a shell operator (`&`, `||`, a redirection): the rest is the shell's.
    end = next((i for i, w in enumerate(words) if w in {"&", "&&", "||", "|", ";"}
                or re.match(r"\d?>|<", w)), len(words))
    return words[:end]


def _inline_commands(page: Path) -> list[str]:
    """Commands quoted inline (`python -m ...`), as in the tables of settings."""
    return re.findall(r"`(python -m [^`]+)`", page.read_text())


ALL = [(_rel(page), command) for page in PAGES
       for command in [c for block in _blocks(page) for c in _commands(block)]
       + _inline_commands(page)]


def _overrides(words: list[str]) -> list[str]:
    """The overrides after `-m app`; of a sweep (a=1,2) the first job's (a quoted '1,2' is
    one value)."""
    words = words[words.index("app") + 1:]
    if "--cfg" in words:
        del words[words.index("--cfg") + 1]  # (its argument: job, hydra or all)
    return [re.sub(r"=([^,\['\"]*),.*", r"=\1", w) if "=" in w else w
            for w in words if not w.startswith("-")]


def _app_commands() -> list[tuple[str, str]]:
    return [(page, c) for page, c in ALL if re.search(r"(^|\s)-m app(\s|$)", c)]


@pytest.mark.parametrize(("page", "command"), [
    pytest.param(page, c, id=f"{page}: {c}") for page, c in _app_commands()
    if "$HOME" not in c and "~/" not in c])  # (those: test_your_own_code_examples_compose)
def test_app_commands_compose(page: str, command: str) -> None:
    """Composed, and validated as the entry validates before it launches anything."""
    from hydra import compose, initialize_config_dir

    from app.config import register_schemas, to_app_config
    from app.resolvers import register_resolvers

    register_schemas()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=_overrides(_words(command)))
    if not any(p in command for p in PLACEHOLDERS):
        to_app_config(composed)  # raises a UserError naming a value the entry would refuse


def _makefile_targets() -> set[str]:
    return set(re.findall(r"(?m)^([a-z][\w-]*):", (REPO / "Makefile").read_text()))


@pytest.mark.parametrize(("page", "command"), [
    pytest.param(page, c, id=f"{page}: {c}") for page, c in ALL if not re.search(
        r"(^|\s)-m app(\s|$)", c)])
def test_other_commands_name_what_exists(page: str, command: str) -> None:
    if inner := re.fullmatch(r"[A-Za-z_]\w*=\$\((.*)\)", command):  # PID=$(grep ...)
        command = inner[1]
    words = _words(command)
    tool = words[0]
    if tool == "make":
        targets = [w for w in words[1:] if "=" not in w]
        assert set(targets) <= _makefile_targets(), f"{page}: `{command}`: no such make target"
    elif tool in ("python", "python3") and words[1] == "-m":
        assert importlib.util.find_spec(words[2]), f"{page}: `{command}`: no module {words[2]}"
    elif tool in ("python", "python3") and words[1] in ("-c", "-"):
        pass  # (a program of the page's own, on the line or in a here-document)
    elif tool in ("python", "python3"):
        written = re.findall(r"(?m)^cat > (\S+) <<", (REPO / page).read_text())  # the page's own
        assert (REPO / words[1]).is_file() or words[1] in written, \
            f"{page}: `{command}`: no file {words[1]}"
    elif tool == "pip":
        extras = re.findall(r"\[([\w,]+)\]", command)
        pyproject = (REPO / "pyproject.toml").read_text()
        for extra in ",".join(extras).split(",") if extras else []:
            assert re.search(rf"(?m)^{extra} = ", pyproject), f"{page}: no extra [{extra}]"
    else:
        assert tool in SHELL_TOOLS, (
            f"{page}: `{command}`: test_readme.py does not know how to check `{tool}`")


def test_your_own_code_examples_compose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks that write a package and a config folder of your own: run their shell part
    in a scratch HOME, import the code they wrote, compose their `python -m app` command."""
    blocks = [(_rel(page), b) for page in PAGES for b in _blocks(page) if "$HOME" in b]
    assert blocks, "no page shows code of your own any more: drop this test"
    for page, block in blocks:
        home = tmp_path / str(len(list(tmp_path.iterdir())))
        home.mkdir()
        shell = "\n".join(line for line in block.splitlines() if "python -m app" not in line)
        done = subprocess.run(["bash", "-euc", shell], cwd=home, capture_output=True, text=True,
                              env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, f"{page}: the example's shell part failed: {done.stderr}"
        monkeypatch.syspath_prepend(str(home / "work"))
        for module in (home / "work").glob("*/*.py"):
            name = f"{module.parent.name}.{module.stem}"
            sys.modules.pop(name, None)
            sys.modules.pop(module.parent.name, None)
            importlib.import_module(name)
        [command] = [c for c in _commands(block) if "python -m app" in c]
        command = command.replace("$HOME", str(home)).replace("~/", f"{home}/")
        make_config(*_overrides(_words(command)))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # (a name inside a module: app.data.DataModule)
        return False


PATH = re.compile(r"`((?:src|conf|tests|bench|scripts|docs)/[\w./-]*)`")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_paths_names_and_links_exist(page: str | Path) -> None:
    page = Path(page)
    text = page.read_text()
    for path in PATH.findall(text) + [f"tests/{t}" for t in re.findall(r"`(test_\w+\.py)`", text)]:
        if not any(c.isupper() for c in path):  # (NAME, DAY/TIME: placeholders)
            assert (REPO / path).exists(), f"{_rel(page)}: {path} does not exist"
    for name in set(re.findall(r"\bapp(?:\.\w+)+", text)):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if _is_module(".".join(parts[:i])):
                obj = importlib.import_module(".".join(parts[:i]))
                for attribute in parts[i:]:
                    assert hasattr(obj, attribute), f"{_rel(page)}: {name} does not exist"
                    obj = getattr(obj, attribute)
                break
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if target.startswith("http"):
            continue
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{_rel(page)}: the link to {target} goes nowhere"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"(?m)^#+ (.+)$", linked.read_text())
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{_rel(page)}: no heading #{anchor} in {target or 'itself'}"


def test_every_module_is_in_the_layout() -> None:
    layout = (REPO / "docs" / "development.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "src" / "app").rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(REPO)}`" not in layout]
    assert not missing, f"docs/development.md's layout does not name {missing}"


def test_the_readme_is_a_front_door() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines: move the manual parts to docs/"


def test_the_step_loop_example_validates_by_steps_only() -> None:
    [command] = [c for _, c in _app_commands() if "val_every_n_steps" in c]
    t = make_config(*_overrides(_words(command))).trainer
    assert t.max_epochs is None and t.val_every_n_steps == 50
    assert t.val_every_n_epochs is None, f"{command} also validates every epoch"


def test_the_readme_lists_every_renamed_key() -> None:
    from app.config import RENAMED

    text = (REPO / "README.md").read_text()
    listed = dict(re.findall(r"(?m)^\| `([\w.]+)` \| `([\w.]+)` \|$", text))
    assert listed == RENAMED, "README.md's renamed keys differ from app.config.RENAMED"


def test_the_reference_is_written_from_conf_and_has_every_key() -> None:
    """docs/reference.md is what scripts/reference.py writes from conf/ (edit conf/, run it),
    and names every key of the composed default config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from app.config import register_schemas

    spec = importlib.util.spec_from_file_location("reference", REPO / "scripts" / "reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    text = (REPO / "docs" / "reference.md").read_text()
    assert text == reference.render(), "docs/reference.md is stale: python scripts/reference.py"
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config"))

    def leaves(node: dict, prefix: str = "") -> list[str]:
        keys = []
        for key, value in node.items():
            if isinstance(value, dict) and value and not key.startswith("_"):
                keys += leaves(value, f"{prefix}{key}.")
            elif not key.startswith("_"):
                keys.append(f"{prefix}{key}")
        return keys

    missing = [key for key in leaves(composed) if f"| `{key}` |" not in text]
    assert not missing, f"docs/reference.md has no row for {missing}: comment them in conf/"
