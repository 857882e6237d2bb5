"""Named policy presets: partial configs that the benchmark compares on identical code paths.

A preset is a YAML mapping shipped in ``marsproxy/data/policies/<name>.yaml`` (``configs/policies``
links there). ``load_config`` lays it beneath the user's file, env and flags.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

_PACKAGE = "marsproxy.data"
_FOLDER = "policies"


class PolicyError(ValueError):
    """An unknown or malformed preset."""


def policy_names() -> list[str]:
    """Every shipped preset, sorted."""
    folder = resources.files(_PACKAGE).joinpath(_FOLDER)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def policy_preset(name: object) -> dict[str, Any]:
    """The preset's mapping (a fresh copy); :class:`PolicyError` names the valid choices."""
    names = policy_names()
    if not isinstance(name, str) or name not in names:
        raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(names)}")
    text = resources.files(_PACKAGE).joinpath(_FOLDER, f"{name}.yaml").read_text("utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict) or "policy" in data:
        raise PolicyError(f"policy preset {name!r} must be a mapping without a 'policy' key")
    return data
