"""The config loader: layering, strictness and error messages that name key and source."""

from __future__ import annotations

from pathlib import Path

import pytest

from marsproxy.config import ConfigError, MarsConfig, env_overrides, load_config

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_without_any_source() -> None:
    cfg = load_config(None, environ={})
    assert cfg == MarsConfig()
    assert cfg.server.port == 8080
    assert cfg.server.max_body_bytes == 32 * 1024 * 1024
    assert cfg.sessions.headers[0] == "x-session-id"


def test_layering_file_then_env_then_cli(tmp_path: Path) -> None:
    p = _write(tmp_path, "server:\n  port: 9001\n  host: 0.0.0.0\nworkers: [http://a:1]\n")
    env = {"MARSPROXY_SERVER__PORT": "9002", "MARSPROXY_UPSTREAM__CONNECT_TIMEOUT_S": "2.5"}
    cfg = load_config(p, environ=env)
    assert cfg.server.port == 9002  # env beats file
    assert cfg.server.host == "0.0.0.0"  # file value kept where env is silent
    assert cfg.upstream.connect_timeout_s == 2.5
    cfg = load_config(p, environ=env, overrides={"server": {"port": 9003}})
    assert cfg.server.port == 9003  # CLI beats env


def test_workers_accept_bare_urls_and_objects(tmp_path: Path) -> None:
    p = _write(tmp_path, "workers:\n  - http://a:8000/\n  - {url: 'http://b:8000', name: b}\n")
    cfg = load_config(p, environ={})
    assert [w.url for w in cfg.workers] == ["http://a:8000", "http://b:8000"]
    assert [w.label for w in cfg.workers] == ["a:8000", "b"]
    env = {"MARSPROXY_WORKERS": "[http://c:1, http://d:2]"}
    assert [w.url for w in load_config(None, environ=env).workers] == ["http://c:1", "http://d:2"]


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "server:\n  prot: 9000\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ={})
    msg = str(exc.value)
    assert "server.prot" in msg and "unknown key" in msg and str(p) in msg


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    p = _write(tmp_path, "upstream:\n  idle_timeout_s: soon\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ={})
    assert "upstream.idle_timeout_s" in str(exc.value) and "'soon'" in str(exc.value)


def test_wrong_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, environ={"MARSPROXY_SERVER__PORT": "70000"})
    assert "server.port" in str(exc.value) and "MARSPROXY_SERVER__PORT" in str(exc.value)


def test_bad_worker_url_is_rejected() -> None:
    with pytest.raises(ConfigError, match="http://"):
        load_config(None, environ={}, overrides={"workers": ["localhost:8000"]})


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"), environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "server: [\n"), environ={})


def test_config_path_from_environment(tmp_path: Path) -> None:
    p = _write(tmp_path, "server:\n  port: 9100\n")
    cfg = load_config(None, environ={"MARSPROXY_CONFIG": str(p)})
    assert cfg.server.port == 9100


def test_env_overrides_parse_yaml_values() -> None:
    tree = env_overrides({"MARSPROXY_SESSIONS__CHAIN_MATCHING": "false", "OTHER": "x"})
    assert tree == {"sessions": {"chain_matching": False}}


def test_example_config_is_complete_and_valid() -> None:
    """configs/marsproxy.yaml sets every key, and to its documented default."""
    from marsproxy.config_reference import example_yaml, iter_keys

    example = REPO / "configs" / "marsproxy.yaml"
    cfg = load_config(example, environ={})
    text = example.read_text()
    assert text == example_yaml(), f"{example} is stale: run `make config-docs`"
    for key, _default, _desc in iter_keys():
        assert f"{key.rsplit('.', 1)[-1]}:" in text, f"{key} missing from {example}"
    assert cfg.model_dump(exclude={"workers"}) == MarsConfig().model_dump(exclude={"workers"})
    assert len(cfg.workers) == 2


def test_example_config_leaves_the_policy_keys_to_the_preset() -> None:
    example = REPO / "configs" / "marsproxy.yaml"
    cfg = load_config(example, environ={}, overrides={"policy": "fcfs"})
    assert not cfg.admission.enabled and cfg.scheduler.priority_policy == "off"
    assert cfg.server.port == 8080  # the rest still comes from the file


def test_reference_doc_matches_the_code() -> None:
    from marsproxy.config_reference import reference_table

    doc = (REPO / "docs" / "configuration.md").read_text()
    assert reference_table() in doc, "docs/configuration.md is stale: run `make config-docs`"
