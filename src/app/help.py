"""The config groups `python -m app --help` lists, with the options of the folders given as
`hydra.searchpath=[...]` on the same command line: Hydra 1.3's $APP_CONFIG_GROUPS lists only
the search path of `@hydra.main` (it reads the groups without the command line's overrides),
so a user's `model: mine` was missing from the help that should show it."""

from __future__ import annotations

import re

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType


def config_groups(hydra_overrides: list[str]) -> str:
    """Every group but Hydra's and its options, a line each, as $APP_CONFIG_GROUPS writes them;
    `hydra_overrides`: the command line's overrides of hydra.* (`${hydra.overrides.hydra}`)."""
    # (Hydra reads the first hydra.searchpath override, as here.)
    searchpath = [o for o in hydra_overrides if re.match(r"\+*hydra\.searchpath=", o)][:1]
    loader = GlobalHydra.instance().config_loader()

    def options(group: str, kind: ObjectType) -> list[str]:
        return sorted(loader.get_group_options(group, kind, overrides=searchpath))

    def groups(parent: str) -> list[str]:
        found = []
        for name in options(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            if group != "hydra":
                found += [group] * bool(options(group, ObjectType.CONFIG)) + groups(group)
        return found

    return "".join(f"{group}: {', '.join(options(group, ObjectType.CONFIG))}\n"
                   for group in sorted(groups("")))
