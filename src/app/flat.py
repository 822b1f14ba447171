"""A config as flat dotted keys: `{"model.channels": [8, 16], "optimizer.lr": 0.01}`. Used to
compare configs (`run=`, `python -m app.runs`) and to log them as tracker parameters."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every value under `node` by its dotted key (a list is one value); interpolations as
    written, not resolved (a saved config may name keys of a run that is gone)."""
    if isinstance(node, DictConfig):
        found: dict[str, Any] = {}
        for key in node:
            found |= leaves(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(node, ListConfig):
        return {prefix: OmegaConf.to_container(node)}
    return {prefix: node._value() if hasattr(node, "_value") else node}
