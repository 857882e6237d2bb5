"""Policy presets: shipped, valid, layered beneath the user's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from marsproxy.config import ConfigError, load_config
from marsproxy.policies import PolicyError, policy_names, policy_preset

EXPECTED = {
    "mars", "fcfs", "autellix", "continuum",
    "mars-no-admission", "mars-no-priority", "mars-no-retention", "mars-least-loaded",
    "mars-no-trees",
}


def test_every_named_preset_ships_and_validates() -> None:
    assert set(policy_names()) == EXPECTED
    for name in policy_names():
        cfg = load_config(None, environ={}, overrides={"policy": name})
        assert cfg.policy == name


def test_presets_differ_where_the_policies_differ() -> None:
    cfgs = {n: load_config(None, environ={}, overrides={"policy": n}) for n in EXPECTED}
    assert cfgs["mars"].admission.enabled and not cfgs["fcfs"].admission.enabled
    assert cfgs["fcfs"].scheduler.priority_policy == "off"
    assert cfgs["autellix"].scheduler.priority_policy == "las"
    assert cfgs["continuum"].scheduler.retention_policy == "fixed"
    assert not cfgs["mars-no-admission"].admission.enabled
    assert cfgs["mars-no-priority"].scheduler.priority_policy == "off"
    assert cfgs["mars-no-retention"].scheduler.retention_policy == "off"
    assert cfgs["mars-no-retention"].admission.enabled
    assert cfgs["mars"].placement.policy == "prefix"
    assert cfgs["mars-least-loaded"].placement.policy == "least_loaded"
    assert cfgs["mars"].sessions.trees and not cfgs["mars-no-trees"].sessions.trees


def test_default_policy_is_mars() -> None:
    assert load_config(None, environ={}).policy == "mars"


def test_file_and_env_win_over_the_preset(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("policy: fcfs\nadmission:\n  enabled: true\n")
    cfg = load_config(f, environ={})
    assert cfg.policy == "fcfs" and cfg.admission.enabled
    assert cfg.scheduler.priority_policy == "off"  # from the preset
    env = {"MARSPROXY_SCHEDULER__PRIORITY_POLICY": "las"}
    assert load_config(f, environ=env).scheduler.priority_policy == "las"


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown policy 'nope'.*mars"):
        load_config(None, environ={"MARSPROXY_POLICY": "nope"})
    with pytest.raises(PolicyError):
        policy_preset(3)


def test_configs_policies_is_the_shipped_folder() -> None:
    root = Path(__file__).resolve().parents[2]
    link = root / "configs" / "policies"
    assert {p.stem for p in link.glob("*.yaml")} == EXPECTED
