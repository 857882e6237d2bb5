"""The config loader: layering, strictness and error messages that name key and source."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

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


@pytest.mark.parametrize("url", ["http://", "http://:8000", "http://a:x", "http://a:99999"])
def test_a_worker_url_needs_a_host_and_a_valid_port(url: str) -> None:
    # Before, these passed `config check` and `serve` died: an IndexError (no host) or the
    # worker's every request failing to parse its URL.
    with pytest.raises(ConfigError, match=r"workers\.0\.url"):
        load_config(None, environ={}, overrides={"workers": [url]})


@pytest.mark.parametrize("workers", [
    ["http://a:1", "http://a:1/"],
    [{"url": "http://a:1", "name": "x"}, {"url": "http://b:1", "name": "x"}],
    [{"url": "http://a:1", "name": "x"}, {"url": "http://a:1", "name": "y"}],
])
def test_two_workers_with_one_name_or_url_are_a_config_error(workers: list[object]) -> None:
    # Before: `config check` passed, `serve` died with a ValueError traceback from the scraper
    # (one name) or accounted one worker's calls to the other (one URL, two names).
    with pytest.raises(ConfigError, match=r"workers: .*(name|url).*twice"):
        load_config(None, environ={}, overrides={"workers": workers})


def test_the_event_stream_redis_url_needs_a_redis_scheme() -> None:
    # Before: accepted, and `serve` died at start in redis' from_url with a traceback.
    with pytest.raises(ConfigError, match=r"telemetry\.redis_stream\.url"):
        load_config(None, environ={}, overrides={"telemetry": {"redis_stream": {
            "url": "localhost:6379"}}})
    cfg = load_config(None, environ={}, overrides={"telemetry": {"redis_stream": {
        "url": "redis://r:6379/0"}}})
    assert cfg.telemetry.redis_stream.url == "redis://r:6379/0"


@pytest.mark.parametrize("endpoint", ["tcp://h", "tcp://h:", "tcp://h:x", "tcp://h:5557/"])
def test_a_kv_events_tcp_endpoint_needs_host_and_port(endpoint: str) -> None:
    # Before: accepted, and the subscriber died at its first connect (Invalid argument).
    with pytest.raises(ConfigError, match=r"workers\.0\.kv_events\.endpoint.*HOST:PORT"):
        load_config(None, environ={}, overrides={"workers": [
            {"url": "http://a:1", "kv_events": {"endpoint": endpoint}}]})
    ok = load_config(None, environ={}, overrides={"workers": [
        {"url": "http://a:1", "kv_events": {"endpoint": "tcp://[::1]:5557"}}]})
    assert ok.workers[0].kv_events is not None


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


def test_the_status_url_variable_is_not_a_config_key() -> None:
    # `marsproxy status` reads MARSPROXY_URL (its --help says so); exported for it, it made
    # `serve` and `config check` in the same shell fail with "url: unknown key".
    env = {"MARSPROXY_URL": "http://127.0.0.1:8080", "MARSPROXY_SERVER__PORT": "9000"}
    assert env_overrides(env) == {"server": {"port": 9000}}
    assert load_config(None, environ=env).server.port == 9000


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


# -- keys that moved or were removed ---------------------------------------------------------


def test_a_moved_key_in_a_file_names_its_new_place(tmp_path: Path) -> None:
    p = _write(tmp_path, "admission:\n  peak_growth_prior: 3.0\n  window_max: 8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ={})
    msg = str(exc.value)
    assert "admission.peak_growth_prior moved to admission.tuning.peak_growth_prior" in msg
    assert str(p) in msg and "window_max" not in msg  # operator keys stay where they were
    p = _write(tmp_path, "admission:\n  tuning:\n    peak_growth_prior: 3.0\n")
    assert load_config(p, environ={}).admission.tuning.peak_growth_prior == 3.0


def test_a_moved_key_in_the_environment_names_the_new_variable() -> None:
    env = {"MARSPROXY_SCHEDULER__TICK_S": "0.5", "MARSPROXY_SERVER__PORT": "9000"}
    with pytest.raises(ConfigError) as exc:
        load_config(None, environ=env)
    msg = str(exc.value)
    assert "scheduler.tick_s moved to scheduler.tuning.tick_s" in msg
    assert "environment variable MARSPROXY_SCHEDULER__TICK_S" in msg
    assert "set MARSPROXY_SCHEDULER__TUNING__TICK_S" in msg
    cfg = load_config(None, environ={"MARSPROXY_SCHEDULER__TUNING__TICK_S": "0.5"})
    assert cfg.scheduler.tuning.tick_s == 0.5


def test_a_moved_key_on_the_command_line_is_an_error() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, environ={}, overrides={"tools": {"quantile": 0.5}})
    assert "tools.quantile moved to tools.tuning.quantile (command line)" in str(exc.value)


def test_the_one_kv_reserve_lives_under_admission() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, environ={}, overrides={"scheduler": {"kv_reserve_frac": 0.2}})
    assert "scheduler.kv_reserve_frac moved to admission.kv_reserve_frac" in str(exc.value)


def test_removed_keys_say_what_happens_now(tmp_path: Path) -> None:
    p = _write(tmp_path, "admission:\n  cpu_overload_order: longest_first\n"
                         "  cpu_cap_always: true\n  classes:\n    reserve_frac: 0.2\n")
    env = {"MARSPROXY_ADMISSION__KV_COUNT_RETAINED": "false"}
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ=env, overrides={"admission": {"cpu_overload_shrinks": True}})
    msg = str(exc.value)
    # Every retired key of every source in one message, each with its source.
    assert "admission.cpu_overload_order was removed: the queue keeps arrival order" in msg
    assert "admission.cpu_cap_always was removed" in msg and str(p) in msg
    assert "admission.kv_count_retained was removed" in msg
    assert "MARSPROXY_ADMISSION__KV_COUNT_RETAINED" in msg
    assert "admission.cpu_overload_shrinks was removed" in msg and "(command line)" in msg
    assert "admission.classes.reserve_frac was removed: later classes' sessions give way" in msg


def test_a_removed_value_names_what_to_set(tmp_path: Path) -> None:
    p = _write(tmp_path, "scheduler:\n  priority_policy: mars\n  tuning:\n"
                         "    level_thresholds: [1, 2, 3]\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ={})
    msg = str(exc.value)
    assert "scheduler.priority_policy: mars was removed; set session_fcfs" in msg
    assert "scheduler.tuning.level_thresholds was removed" in msg and str(p) in msg
    env = {"MARSPROXY_SCHEDULER__PRIORITY_POLICY": "mars"}
    with pytest.raises(ConfigError, match="MARSPROXY_SCHEDULER__PRIORITY_POLICY"):
        load_config(None, environ=env)
    cfg = load_config(None, environ={}, overrides={"scheduler": {"priority_policy": "las"}})
    assert cfg.scheduler.priority_policy == "las"  # other values pass untouched


def test_the_retired_table_matches_the_models() -> None:
    from marsproxy.config_moves import MOVED, REMOVED
    from marsproxy.config_reference import iter_keys

    keys = {k for k, _, _ in iter_keys()}
    assert set(MOVED.values()) <= keys, "every replacement exists"
    assert not (set(MOVED) | set(REMOVED)) & keys, "no retired path is a key today"


def test_every_policy_preset_loads() -> None:
    from marsproxy.policies import policy_names

    for name in policy_names():
        cfg = load_config(None, environ={}, overrides={"policy": name})
        assert cfg.policy == name
    continuum = load_config(None, environ={}, overrides={"policy": "continuum"})
    assert continuum.scheduler.tuning.fixed_retention_s == 2.0


def test_the_docs_state_the_operator_and_tuning_key_counts() -> None:
    import re

    from marsproxy.config_reference import is_tuning, iter_keys, tuning_sections

    keys = [k for k, _, _ in iter_keys()]
    tuned = [k for k in keys if is_tuning(k)]
    doc = (REPO / "docs" / "configuration.md").read_text()
    stated = re.search(r"There are (\d+) operator keys.*?internals \((\d+) keys\)", doc, re.S)
    assert stated, "docs/configuration.md must state the key counts"
    assert (int(stated[1]), int(stated[2])) == (len(keys) - len(tuned), len(tuned))
    assert [s for s, _ in tuning_sections()] == [
        "probes.tuning", "tools.tuning", "admission.tuning", "scheduler.tuning"]
    for section, _ in tuning_sections():
        assert f"`{section}.*`" in doc


def _float_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """Every key whose value is or holds a float, with an infinity in the value's shape."""
    keys: list[tuple[str, Any]] = []
    for name, f in model.model_fields.items():
        kinds = [f.annotation, *typing.get_args(f.annotation)]
        sub = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if sub:
            keys += _float_keys(sub[0], f"{prefix}{name}.")
        elif float not in kinds:
            continue
        elif typing.get_origin(f.annotation) is dict:
            keys.append((prefix + name, {"k": math.inf}))
        elif typing.get_origin(f.annotation) is tuple:
            keys.append((prefix + name, (math.inf,) * (len(kinds) - 1)))
        else:
            keys.append((prefix + name, math.inf))
    return keys


def test_every_float_key_refuses_infinity_and_nan() -> None:
    keys = _float_keys(MarsConfig)
    assert len(keys) > 50  # the walk found the sections' keys
    for key, inf in keys:
        for bad in (inf, json.loads(json.dumps(inf).replace("Infinity", "NaN"))):
            over: dict[str, Any] = {"workers": ["http://w:1"]}
            *parents, leaf = key.split(".")
            node = over
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = bad
            with pytest.raises(ConfigError, match="finite number") as exc:
                load_config(None, environ={}, overrides=over)
            assert key in str(exc.value), (key, str(exc.value))
    with pytest.raises(ConfigError, match="finite number"):  # from the environment too
        load_config(None, environ={"MARSPROXY_SESSIONS__IDLE_TTL_S": "inf"})
