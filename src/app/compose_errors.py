"""Composition errors that Hydra would show as a traceback, or with the wrong advice, told in
one line.

Hydra composes the config before our task function runs, inside its own error handler
(`hydra._internal.utils.run_and_report`): a YAML file it cannot parse comes out as some 90
lines of traceback, a value outside a closed set or of the wrong type over five lines, an
unknown group option with the config search path, an override it cannot parse with a link,
all with exit status 1, and a misspelt key as advice to append it with `+` (which a typed
section then rejects, and which for a `_target_` group passes the misspelling on). Each is
one line here, and exit status 2, as for the app's own checks of a value. Everything is left
to Hydra when HYDRA_FULL_ERROR is set.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

from app._private import hydra_entry_utils
from app.config import renamed


def yaml_error_line(e: yaml.YAMLError) -> str:
    """`FILE, line L, column C: what is wrong (context at line L', column C')`."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
    where = "a config file is not valid YAML"
    if mark is not None:
        name = mark.name if mark.name and not mark.name.startswith("<") else "a config file"
        where = f"{name}, line {mark.line + 1}, column {mark.column + 1}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        problem += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return f"{where}: {problem}; fix the YAML there"


def _config_file(e: BaseException) -> str | None:
    """The config file Hydra was reading when `e` was raised (a local of its file loader)."""
    tb, found = e.__traceback__, None
    while tb is not None:
        path = tb.tb_frame.f_locals.get("full_path")
        if tb.tb_frame.f_code.co_name == "load_config" and isinstance(path, str):
            found = path
        tb = tb.tb_next
    return found


def _target_keys(node: DictConfig) -> tuple[str | None, list[str]]:
    """The `_target_` of a node and the keyword arguments with defaults it accepts: the knobs a
    config file may leave out (those without a default are passed in by app itself)."""
    target = node.get("_target_") if "_target_" in node else None
    if not isinstance(target, str):
        return None, []
    try:
        from hydra.utils import get_object

        parameters = inspect.signature(get_object(target)).parameters.values()
    except Exception:  # not importable, not inspectable: no hint from it then
        return target, []
    return target, [p.name for p in parameters if p.default is not inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def missing_key_line(override: str, value: str | None, cause: Exception) -> str | None:
    """One line for an override of a key the config does not have, with the nearest real key.
    `override` is the key as typed (`trainer.max_epoch`); `cause` is OmegaConf's error."""
    parent, key, full = (getattr(cause, "parent_node", None), getattr(cause, "key", None),
                         getattr(cause, "full_key", None))
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or not full:
        return None
    prefix = full[: -len(key)] if full.endswith(key) else ""  # "trainer." or "" at the root
    rest = override[len(full):] if override.startswith(full) else ""  # the part after `key`
    keys = [str(k) for k in parent.keys()]
    typed = OmegaConf.get_type(parent) not in (dict, None)
    target, arguments = (None, []) if typed else _target_keys(parent)
    extra = [a for a in arguments if a not in keys]
    near = difflib.get_close_matches(key, keys + extra, n=1)
    shown = f"={value}" if value is not None else ""
    if near and near[0] in keys:
        return f"{override}: no such key; did you mean {prefix}{near[0]}{rest}?"
    if near:  # an argument the config file leaves at its default: adding it takes a `+`
        return (f"{override}: no such key; did you mean +{prefix}{near[0]}{rest}{shown}? "
                f"({target} takes {near[0]}; the config does not set it, so it needs a +)")
    section = prefix.rstrip(".") or "the config"
    if target is not None:  # a new argument of the target is legitimate, with `+`
        return (f"{override}: no such key in {section} (keys: {', '.join(keys)}); to pass "
                f"a new argument to {target}, write +{override}{shown}")
    if OmegaConf.get_type(parent) is dict and prefix:  # a mapping of the user's own keys
        return (f"{override}: {section} has no key {key} yet; a new key takes a +: "
                f"+{override}{shown}")
    which = "hydra" if section == "hydra" or section.startswith("hydra.") else "job"
    listing = f"`python -m app --cfg {which} --package {section}`" if prefix else \
        "`python -m app --cfg job`"
    return f"{override}: no such key in {section}; {listing} prints its keys"


def choice_line(e: ValidationError) -> str | None:
    """`KEY=VALUE: expected one of A, B, C` for a value outside a closed set (an Enum of
    app.config), which OmegaConf reports over five lines with the schema's class names."""
    match = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(e.msg))
    if not match or not getattr(e, "full_key", None):
        return None
    return f"{e.full_key}={match[1]}: expected one of {match[2]}"


# OmegaConf's names of the types a value could not be converted to, in the app's words.
_EXPECTED = {"Integer": "a whole number", "Float": "a number", "String": "a string"}


def type_line(e: ValidationError) -> str | None:
    """`KEY=VALUE: expected a whole number` for a value of the wrong type, which OmegaConf
    reports over five lines with the schema's class names."""
    msg, key = str(e.msg), getattr(e, "full_key", None)
    if not key:
        return None
    if match := re.match(r"Value '(.*)' of type '.*' could not be converted to (\w+)", msg, re.S):
        return f"{key}={match[1]}: expected {_EXPECTED.get(match[2], match[2])}"
    if match := re.match(r"Value '(.*)' is not a valid bool", msg, re.S):
        return f"{key}={match[1]}: expected true or false"
    if re.match(r"field '.*' is not Optional", msg):
        return f"{key}=null: {key} cannot be null; give it a value"
    return None


def option_line(e: MissingConfigException) -> str | None:
    """`GROUP=NAME: no such option; did you mean ...? (options: ...)` for an unknown option of
    a config group, which Hydra reports with the whole config search path."""
    text = str(e)
    match = re.search(r"Could not find '([^']+)/([^'/]*)'", text)
    if not match:
        return None
    group, name = match[1], match[2]
    listed = re.search(r"Available options in '[^']+':\n((?:\t.*(?:\n|$))*)", text)
    options = [o.strip() for o in listed[1].splitlines() if o.strip()] if listed else []
    near = difflib.get_close_matches(name, options, n=1)
    source = re.match(r"In '([^']+)': ", text)
    # (The primary config's or Hydra's own defaults: the command's override; else a file's.)
    where = f"{source[1]}: " if source and source[1] != "config" and not \
        source[1].startswith("hydra/") else ""
    hint = f"; did you mean {group}={near[0]}?" if near else ""
    known = f"options: {', '.join(options)}" if options else \
        f"the group {group} has no options here; is it on hydra.searchpath?"
    if not name:
        return f"{where}{group}=: no option given ({known})"
    # As typed: +experiment=nope, not experiment=nope.
    typed = next((a for a in sys.argv[1:] if a.lstrip("+") == f"{group}={name}"), None)
    if typed is None and not where:  # (Hydra names the primary config for a file's override)
        where = next((f"{f}: " for f in _chosen_files_choosing(group, name, text)), "")
    return f"{where}{typed or f'{group}={name}'}: no such option{hint} ({known})"


def _chosen_files_choosing(group: str, name: str, text: str) -> Iterator[str]:
    """The config files the command chose (`experiment=mine`: experiment/mine) whose defaults
    list sets `group` to `name` (`override /model: nope`), as GROUP/OPTION, from the file
    folders of the search path that Hydra's message lists."""
    folders = [Path(f) for f in re.findall(r"path=file://(\S+)", text)]
    keys = {group, f"/{group}", f"override {group}", f"override /{group}"}
    for _, parsed in _command_overrides():
        if parsed is None or not isinstance(parsed.value(), str):
            continue
        chosen = f"{parsed.key_or_group}/{parsed.value()}"
        for folder in folders:
            try:
                loaded = yaml.safe_load((folder / f"{chosen}.yaml").read_text())
            except (OSError, yaml.YAMLError):
                continue
            defaults = loaded.get("defaults") if isinstance(loaded, dict) else None
            if any(isinstance(d, dict) and any(k in keys and v == name for k, v in d.items())
                   for d in defaults or []):
                yield chosen


def _command_overrides() -> Iterator[tuple[str, Any]]:
    """Each override of the command as typed, with Hydra's parse of it (None: its grammar
    rejects it); Hydra's own flags (--multirun, -cn ...) left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for argument in (a for a in sys.argv[1:] if not a.startswith("-")):
        try:
            yield argument, parser.parse_override(argument)
        except HydraException:  # (one override's error is not an OverrideParseException)
            yield argument, None


def _unparsable() -> str | None:
    """The first of the command's overrides that Hydra's grammar rejects."""
    return next((argument for argument, parsed in _command_overrides() if parsed is None), None)


def parse_line(e: OverrideParseException) -> str:
    """`OVERRIDE: not a valid override (why); the forms` for what Hydra's override grammar
    rejects, which it reports over three lines, not always naming the override."""
    lines = [line for line in str(e).splitlines() if line and not line.startswith("See http")]
    named = re.match(r"Error parsing override '(.*)'$", lines[0]) if lines else None
    override = named[1] if named else _unparsable()
    reason = "; ".join(lines[1:] if named else lines) or "a syntax error"
    lexer = "LexerNoViableAltException: "  # (its next line's caret points at the character)
    if lines and lines[0].startswith(lexer) and len(lines) > 1 and lines[1].strip() == "^":
        text, at = lines[0][len(lexer):], len(lines[1]) - 1 - len(lexer)
        if 0 <= at < len(text):
            char, in_key = text[at], at < text.find("=") or "=" not in text
            why = "an unclosed quote" if char in "'\"" else \
                "a character a key cannot hold" if in_key else \
                "a character an unquoted value cannot hold (quote the value: KEY='...')" \
                if not char.isascii() else "a character that cannot start a value"
            reason = f"{char!r} at character {at + 1}: {why}"
    return (f"{override + ': ' if override else ''}not a valid override ({reason}); write "
            f"KEY=VALUE, +KEY=VALUE to add a key, ~KEY to remove one, and quote values with "
            f"spaces or brackets (https://hydra.cc/docs/advanced/override_grammar/basic/)")


def override_line(e: Exception) -> str | None:
    """One line for what Hydra says of an override it parsed but cannot apply: a comma value
    without --multirun, a key it cannot remove, a group given no option name."""
    text = str(e)
    if match := re.match(r"Ambiguous value for argument '(.*)'", text):
        return (f"{match[1]}: a comma makes a sweep, which needs --multirun (-m); a list is "
                f"KEY=[A,B], a string with a comma is quoted: KEY='A,B'")
    if match := re.match(r"Could not delete from config\. '(.*)' does not exist", text):
        return (f"~{match[1]}: no such key, or its value is null already (Hydra removes only "
                f"keys that hold a value); to change it, write {match[1]}=VALUE")
    if re.match(r"Could not delete ''", text):
        return "~: give the key or group to remove (~KEY)"
    if re.match(r"Config group override must be a string or a list", text):
        argument, group = _group_given_no_name()
        if group:
            return (f"{argument}: {group} is a config group: give the name of one of its "
                    f"options ({group}=NAME)")
        return f"{argument or 'an override'}: no key before '='; write KEY=VALUE"
    return None


def _group_given_no_name() -> tuple[str | None, str]:
    """The override that gives a config group something other than an option's name (or
    has no key), and the group."""
    from app.conf_dir import config_dir

    groups = {p.name for p in config_dir().iterdir() if p.is_dir()}
    for argument, parsed in _command_overrides():
        if parsed is not None and (not parsed.key_or_group or (
                parsed.key_or_group in groups and not isinstance(parsed.value(), str | list))):
            return argument, parsed.key_or_group
    return None, ""


def _raised_by_the_job(e: BaseException) -> bool:
    """Whether `e` came from inside the task function (a job's own error, reported by the job
    path), not from Hydra's composition before it."""
    # (Matched by file and name: under `python -m app` the entry module is `__main__`, and
    # importing app.__main__ would run it a second time.)
    entry = str(Path(__file__).with_name("__main__.py"))
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "main" and code.co_filename == entry:
            return True
        tb = tb.tb_next
    return False


def explain(e: BaseException) -> str | None:
    """One line for a composition error that Hydra would not say well, else None."""
    if _raised_by_the_job(e):
        return None
    seen = e
    while seen is not None:  # a YAML error may come wrapped by Hydra or OmegaConf
        if isinstance(seen, yaml.YAMLError):
            return yaml_error_line(seen)
        if isinstance(seen, UnicodeDecodeError) and (path := _config_file(seen)):
            return (f"{path}: not UTF-8 text (byte {seen.object[seen.start]:#04x} at offset "
                    f"{seen.start}); save it as UTF-8")
        seen = seen.__cause__ or seen.__context__
    if isinstance(e, MissingConfigException):
        return option_line(e)
    if isinstance(e, OverrideParseException):
        return parse_line(e)
    cause = e.__cause__
    if isinstance(e, ConfigCompositionException) and isinstance(cause, ValidationError):
        return choice_line(cause) or type_line(cause)
    if isinstance(e, ConfigCompositionException) and isinstance(cause, ConfigTypeError) and \
            "does not support deletion" in str(cause) and (key := cause.full_key):
        section = key.rpartition(".")[0] or "the config"
        return (f"~{key}: the keys of {section} cannot be removed (a typed section); set it "
                f"instead: {key}=VALUE")
    swept = re.match(r"Sweeping over Hydra's configuration is not supported : '(.*)'$", str(e))
    if isinstance(e, ConfigCompositionException) and swept:
        key, _, value = swept[1].partition("=")
        line = f"{swept[1]}: Hydra's own settings cannot be swept"
        if "/" in key or "'" in value or '"' in value:  # a group's choice; a quoted value
            return line
        return f"{line}; if the commas belong to the value, quote it: {key}='{value}'"
    if isinstance(e, ConfigCompositionException | ValueError) and (line := override_line(e)):
        return line
    if isinstance(e, ConfigCompositionException) and isinstance(
            cause, ConfigKeyError | ConfigAttributeError):
        match = re.match(r"Could not override '([^']+)'", str(e))
        if match:
            value = re.search(r"use \+\S+?=(.*)$", str(e), re.M)
            value = value[1] if value else None
            return renamed(match[1], value) or missing_key_line(match[1], value, cause)
    source = re.match(r"In '([^']+)': ", str(e))
    merged = e.__context__  # a config file's key or value (Hydra raises without `from`)
    if isinstance(e, ConfigCompositionException) and source:
        if isinstance(merged, ConfigKeyError) and (line := renamed(merged.full_key or "") or (
                merged.full_key and missing_key_line(merged.full_key, None, merged))):
            return f"{source[1]}: {line}"
        if isinstance(merged, ValidationError) and (
                line := choice_line(merged) or type_line(merged)):
            return f"{source[1]}: {line}"
    return None


def explain_composition_errors() -> None:
    """Wrap the function Hydra runs inside its error handler, so that what `explain` knows
    reaches the user as one line and exit status 2 instead of Hydra's report. Hydra offers no
    hook for composition errors: this replaces the module attribute its entry point calls, and
    does nothing when that attribute is missing (another Hydra) or HYDRA_FULL_ERROR is set."""
    utils = hydra_entry_utils()  # app._private: None where another Hydra lacks it
    report = getattr(utils, "run_and_report", None)
    if report is None or getattr(report, "app_wrapped", False):
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composed() -> Any:
            try:
                return func()
            except Exception as e:
                line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else explain(e)
                if line is None:
                    raise
                print(line, file=sys.stderr)
                sys.exit(2)  # SystemExit passes Hydra's handler, which catches Exception only

        return report(composed)

    run_and_report.app_wrapped = True  # type: ignore[attr-defined]
    utils.run_and_report = run_and_report
