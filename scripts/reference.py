"""Write docs/reference.md: every group, option and key of the config, with its default and
what it does, from the comments in conf/ and the loader keys of src/app/config.py.

Run `python scripts/reference.py` after changing either; tests/test_readme.py fails while the
page is not what this writes. `python -m app --help` points to the page (a wheel ships it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PAGE = REPO / "docs" / "reference.md"
LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[\w.]+):(?:\s+(?P<value>[^#\s].*?))?"
                  r"(?:\s+#\s?(?P<what>.*))?$")
SKIPPED = {"defaults", "hydra", "_target_", "_partial_"}
# Groups in the order of conf/config.yaml's defaults list; not reference material: hydra/.
GROUPS = ["trainer", "model", "data", "optimizer", "scheduler", "distributed", "logger",
          "callbacks", "debug", "launcher", "hparams_search", "experiment"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _about(lines: list[str]) -> str:
    """The comment lines a file starts with, as one paragraph."""
    about = []
    for line in lines:
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").rstrip()
        if text.startswith("python -m "):  # an example command, and what it shows
            command, _, note = text.partition("  (")
            text = f"`{command.strip()}`" + (f" ({note}" if note else "") + "."
        if "@package" not in line and text:
            about.append(text)
    return " ".join(about)


def _keys(lines: list[str], prefix: str) -> list[tuple[str, str, str]]:
    """(key, default, what) of every key a YAML file sets, nested keys dotted."""
    rows, stack = [], []  # stack: (indent, key) of the mappings the line is in
    block = None  # the indent of a block scalar's key (`|-`): its lines are text, not keys
    for line in lines:
        match = LINE.match(line)
        indent = len(line) - len(line.lstrip())
        if block is not None and (indent > block or not line.strip()):
            continue
        block = None
        if not match or line.lstrip().startswith(("#", "-")):
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, value = match["key"], match["value"] or ""
        if value in ("|", "|-", ">", ">-"):
            block = indent
        if not value:  # a mapping: its keys follow, indented
            stack.append((indent, key))
            continue
        if key in SKIPPED or any(k in SKIPPED for _, k in stack):
            continue
        dotted = ".".join([prefix, *(k for _, k in stack), key] if prefix else
                          [*(k for _, k in stack), key])
        rows.append((dotted, value, match["what"] or ""))
    return rows


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    if not rows:
        return []
    return ["| key | default | what |", "| --- | --- | --- |",
            *(f"| `{key}` | `{_cell(value)}` | {_cell(what)} |" for key, value, what in rows),
            ""]


def _loader_keys() -> list[tuple[str, str, str]]:
    """LoaderConfig's fields (every data option has them), from src/app/config.py's source."""
    source = (REPO / "src" / "app" / "config.py").read_text()
    body = source.split("class LoaderConfig:")[1].split("\n\n\n")[0]
    rows = []
    for name, default, what in re.findall(r"\n    (\w+): [^=]+= (.+?)  # (.*)", body):
        bound = re.match(r"_bound\((.+?),", default)
        value = bound[1] if bound else default
        rows.append((f"data.{name}", {"None": "null", "True": "true", "False": "false"}.get(
            value, value), what))
    return rows


def render() -> str:
    config = (CONF / "config.yaml").read_text().splitlines()
    chosen = dict(re.findall(r"^  - (\w+): (\w+)", "\n".join(config), flags=re.M))
    out = ["# Reference: every group and key", "",
           "<!-- Written by scripts/reference.py from the comments in conf/: edit those and run "
           "it. -->",
           "Every key of the config, with its default and what it does, as the comments in "
           "`conf/` say. How the config is shaped, presets and your own options: "
           "[configuration.md](configuration.md). Print a composed config with "
           "`python -m app --cfg job`.", "", "## Top level", "",
           "Set on the command line as `KEY=VALUE` (`conf/config.yaml`).", "",
           *_table(_keys(config, ""))]
    for group in GROUPS:
        folder = CONF / group
        out += [f"## {group}", ""]
        if group == "data":
            out += ["Every data option has the loader keys (`app.config.LoaderConfig`):", "",
                    *_table(_loader_keys())]
        for path in sorted(folder.rglob("*.yaml")):
            lines = path.read_text().splitlines()
            nested = path.parent != folder  # callbacks/NAME/default.yaml
            option = f"+{group}/{path.parent.name}=default" if nested else \
                f"{group}={path.stem}" if group != "experiment" else f"+experiment={path.stem}"
            default = " (default)" if chosen.get(group) == path.stem and not nested else ""
            target = re.search(r"^_target_: (\S+)", "\n".join(lines), flags=re.M)
            built = f" Builds `{target[1]}`." if target else ""
            out += [f"### `{option}`{default}", "", f"{_about(lines)}{built}".strip(), ""]
            package_global = any("@package _global_" in line for line in lines[:3])
            prefix = "" if package_global else \
                f"{group}.{path.parent.name}" if nested else group
            out += _table(_keys(lines, prefix))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(REPO)}", file=sys.stderr)
