"""What app adds to Hydra's report of a config it cannot compose.

After Hydra's own report (exit status 1, before the task function runs), `python -m app`
composes the same overrides once more with Hydra's compose API to hold the exception, and adds
one line where Hydra's words leave the user looking: where a config file is not valid YAML,
the nearest key to a misspelt one (or a moved key's new name), the nearest option of a group
(or where an option of your own goes), the file of a group option that is not a mapping, a ~
the shell did not expand, a `hydra.searchpath` written so that Hydra refuses it or finds nothing
in it.
The exit status is then 2, bad input. Nothing is composed again once a job started, nor
with HYDRA_FULL_ERROR=1 (Hydra raises, its traceback left alone).
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.utils import get_object
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError

from app.conf_dir import config_dir
from app.config import register_schemas, renamed

# Hydra's flags that take the next argument as their value; and those after which the
# arguments are not overrides of conf/config.yaml (another config, tab completion's): left to
# Hydra's report alone.
_VALUED = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
           "-cd", "--config-dir", "--experimental-rerun"}
_NOT_HERE = _VALUED - {"-c", "--cfg", "-p", "--package"} | {"-sc", "--shell-completion"}


def after_hydras_report(argv: list[str]) -> int:
    """Print what app adds to Hydra's report of a refused command; the exit status: 2 when
    the config cannot be composed, else Hydra's 1."""
    overrides, flags, args = [], {}, iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if not arg.startswith("-"):
            overrides.append(arg)
        else:
            flags[name] = value if eq else next(args, "") if name in _VALUED else "yes"
    error = None if _NOT_HERE & flags.keys() else \
        compose_error(overrides, multirun=bool({"-m", "--multirun"} & flags.keys()))
    if error is None:
        return 1
    if (line := addition(error, overrides)) is not None:
        print(line, file=sys.stderr)
    return 2


def compose_error(overrides: list[str], multirun: bool = False) -> Exception | None:
    """The exception composing `overrides` raises (None: it composes)."""
    register_schemas()  # (done already by the entry; a test or a notebook may not have)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            for job in _jobs(overrides, multirun):
                compose("config", overrides=job)
    except Exception as e:
        return e
    return None


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The command's overrides; in a sweep, with each swept key at its first value, then each
    of its other values in turn. (Hydra refuses a sweep of its own settings: kept as typed.)"""
    base: list[str | None] = list(overrides)
    others = []
    for i, override in enumerate(OverridesParser.create().parse_overrides(overrides)):
        if multirun and override.is_sweep_override() and not override.is_hydra_override():
            try:  # (a glob or an interval is not enumerated here: left out)
                values = [f"{override.get_key_element()}={value}"
                          for value in override.sweep_string_iterator()]
            except HydraException:
                values = []
            base[i] = values[0] if values else None
            others += [(i, value) for value in values[1:]]
    return [[a for a in base if a is not None]] + [
        [value if j == i else a for j, a in enumerate(base) if a is not None]
        for i, value in others]


def addition(error: BaseException, overrides: list[str]) -> str | None:
    """The line app adds to Hydra's report of `error` (None: Hydra's says it all)."""
    seen: BaseException | None = error
    while seen is not None:  # (a YAML error may come wrapped)
        if isinstance(seen, yaml.MarkedYAMLError) and (seen.problem_mark or seen.context_mark):
            mark = seen.problem_mark or seen.context_mark
            return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: "
                    f"{seen.problem or seen.context}")
        seen = seen.__cause__ or seen.__context__
    if (line := _searchpath_line(error, overrides)) is not None:
        return line
    if isinstance(error, OverrideParseException):
        return _tilde_line(overrides)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        return _option_line(error, overrides)
    cause = error.__cause__ or error.__context__  # (a config file's key: raised without from)
    if isinstance(cause, ConfigKeyError | ConfigAttributeError):
        return _key_line(cause, overrides)
    return _list_option_line(error, overrides)


def _option_line(error: MissingConfigException, overrides: list[str]) -> str | None:
    """`GROUP=NAME: did you mean GROUP=NEAR?` for an option its group does not have."""
    group, _, name = error.missing_cfg_file.rpartition("/")
    if not group:
        return None
    typed = next((a for a in overrides if a.lstrip("+") == f"{group}={name}"), f"{group}={name}")
    near = difflib.get_close_matches(name, error.options or [], n=1)
    if near:
        return f"{typed}: did you mean {typed[:typed.index(group)]}{group}={near[0]}?"
    if any(a.lstrip("+").startswith("hydra.searchpath=") for a in overrides):
        return None  # (Hydra's report lists where it looked)
    return (f"{typed}: an option of your own is a file {group}/{name}.yaml in a folder of "
            f"yours, given as hydra.searchpath=[file://FOLDER] (docs/quickstart.md)")


def _searchpath_line(error: BaseException, overrides: list[str]) -> str | None:
    """What to write for a `hydra.searchpath` Hydra refused (a ~, which it does not expand;
    no brackets) or found no option in (a folder that is not there, or one level off)."""
    typed = next((a for a in overrides if re.match(r"\+*hydra\.searchpath=", a)), None)
    first = str(error).partition("\n")[0]
    not_found = isinstance(error, MissingConfigException) and error.missing_cfg_file
    if typed is None or not (not_found or "hydra.searchpath" in first):
        return None
    value = typed.partition("=")[2].strip()
    listed = value.startswith("[") and value.endswith("]")
    # (scheme, path) of each folder; Hydra reads one without a scheme as file://.
    folders = [(scheme, path) if sep else ("file", scheme) for scheme, sep, path in (
        e.strip(" '\"").partition("://") for e in value.strip(" '\"[]").split(",")
        if e.strip(" '\""))]

    def written(folders: list[tuple[str, str]]) -> str:
        shown = [f"file://$HOME{path[1:]}" if scheme == "file" and re.match(r"~(/|$)", path)
                 else f"{scheme}://{path}" for scheme, path in folders]
        return f'"hydra.searchpath=[{",".join(shown)}]"'  # ($HOME expands in "", [ is kept)

    tilde = any(s == "file" and re.match(r"~(/|$)", p) for s, p in folders)
    if tilde or not listed:
        why = "Hydra does not expand ~" if tilde else "Hydra takes a list, in brackets"
        return f"{typed}: {why}; write {written(folders)}"
    if not not_found:
        return None
    absent = [p for s, p in folders if s == "file" and not Path(p).is_dir()]
    if absent:
        if "$" in absent[0]:
            where = " (the shell leaves a $ in '...' as it is: quote with \"...\")"
        else:
            where = "" if Path(absent[0]).is_absolute() else \
                f" in {Path.cwd()}, the folder the command runs in"
        return f"{typed}: the folder {absent[0]} does not exist{where}"
    # A folder one level off: `conf/model` or `myproject` for `myproject/conf`.
    group, _, name = error.missing_cfg_file.rpartition("/")
    for i, (scheme, path) in enumerate(folders):
        folder = Path(path)
        if scheme != "file" or not group:
            continue
        found = [folder.parent] if folder.name == group and (folder / f"{name}.yaml").is_file() \
            else [p.parents[1] for p in sorted(folder.glob(f"*/{group}/{name}.yaml"))]
        if found:
            better = folders[:i] + [("file", str(found[0]))] + folders[i + 1:]
            return (f"{typed}: {group}/{name}.yaml is not in {path} but in {found[0]}; write "
                    f"{written(better)}")
    return None


def _tilde_line(overrides: list[str]) -> str | None:
    """A `~` after `=` (`data.root=~/photos`): the shell expands it only at a word's start."""
    typed = next((a for a in overrides if re.search(r"=~(/|$)", a)), None)
    if typed is None:
        return None
    key, _, value = typed.partition("=")
    return f"{typed}: the shell leaves a ~ after = as it is; write {key}=$HOME{value[1:]}"


def _key_line(cause: Exception, overrides: list[str]) -> str | None:
    """`KEY: did you mean NEAR?` for a key the config does not have (OmegaConf's error names
    the node it looked in), or the new name of a key that moved."""
    parent, key, full = (getattr(cause, name, None) for name in ("parent_node", "key", "full_key"))
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or not full:
        return None
    # The key as typed (`modle.channels=8` for the key `modle`); a config file's: `full`.
    typed = (a.lstrip("+~").partition("=") for a in overrides)
    name, eq, value = next((t for t in typed if t[0] == full or t[0].startswith(f"{full}.")),
                           (full, "", None))
    value = value if eq else None
    if line := renamed(name, value):
        return line
    keys = [str(k) for k in parent.keys() if k != key]
    arguments = [a for a in _arguments(parent) if a not in keys and a != key]
    near = difflib.get_close_matches(key, keys + arguments, n=1)
    if not near:  # (Hydra's report says to add it with a +: the constructor would refuse it)
        signature = _signature(parent)
        if signature is None or any(p.kind is p.VAR_KEYWORD
                                    for p in signature.parameters.values()):
            return None
        takes = sorted({k for k in keys if not k.startswith("_")} | set(arguments))
        return f"{name}: {parent['_target_']} takes no {key} (it takes {', '.join(takes)})"
    path, rest = full[:len(full) - len(key)], name[len(full):]
    if near[0] in keys:
        return f"{name}: did you mean {path}{near[0]}{rest}?"
    shown = f"={value}" if value is not None else ""  # an argument the node leaves out
    return (f"{name}: did you mean +{path}{near[0]}{rest}{shown}? ({parent['_target_']} "
            f"takes {near[0]}; the config does not set it, so it takes a +)")


def _list_option_line(error: BaseException, overrides: list[str]) -> str | None:
    """`FILE: GROUP=NAME is a list ...` for a group option whose file holds a list (the typed
    `model`, `data`, ... nodes refuse it in composition): Hydra's report names the option but
    only says that OmegaConf cannot merge a DictConfig with a ListConfig."""
    option = re.match(r"In '(\w+)/([^']+)'", str(error))
    cause = error.__cause__ or error.__context__
    if not option or not isinstance(cause, ConfigTypeError) or "ListConfig" not in str(cause):
        return None
    group, name = option.groups()
    try:  # (composed without that group's overrides, to see where the config files are)
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("config", overrides=[
                a for a in overrides if not re.match(rf"[+~]*{group}[.=]", a)],
                return_hydra_config=True)
    except Exception:
        return None
    path = next((p for s in cfg.hydra.runtime.config_sources if s.schema == "file"
                 and (p := Path(s.path, group, f"{name}.yaml")).is_file()), f"{group}/{name}")
    return (f"{path}: {group}={name} is a list at its top level; a config group option must "
            f"be a mapping (`key: value` lines)")


def _signature(node: DictConfig) -> inspect.Signature | None:
    """The signature of a `_target_` node's constructor."""
    try:
        return inspect.signature(get_object(node["_target_"]))
    except Exception:  # no `_target_` (a typed section), not importable, not inspectable
        return None


def _arguments(node: DictConfig) -> list[str]:
    """The arguments with a default that the constructor of a `_target_` node takes."""
    signature = _signature(node)
    return [] if signature is None else [
        p.name for p in signature.parameters.values() if p.default is not p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

