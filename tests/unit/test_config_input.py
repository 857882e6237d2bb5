"""Reading what a user wrote: YAML errors that name the file, keys given twice, and validation
messages that say what was refused without noise or credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

from marsproxy.config import ConfigError, load_config


def _error(tmp_path: Path, text: str | bytes) -> str:
    p = tmp_path / "c.yaml"
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p, environ={})
    return str(exc.value)


def test_a_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    # Before: the position was given 'in "<unicode string>"'.
    msg = _error(tmp_path, "server:\n  port: [1\n")
    assert f'in "{tmp_path / "c.yaml"}", line 2, column 9' in msg
    assert "<unicode string>" not in msg


def test_bytes_that_are_not_utf8_are_refused_naming_the_file(tmp_path: Path) -> None:
    # Before: UnicodeDecodeError, not a ConfigError (a traceback out of `config check`).
    msg = _error(tmp_path, b"server:\n  host: \xff\n")
    assert msg == f"config file {tmp_path / 'c.yaml'}: not UTF-8 text (byte 16: invalid start byte)"
    # A character YAML refuses in valid UTF-8 is a YAML error, with its position.
    msg = _error(tmp_path, "server:\n  host: a\x07b\n")
    assert msg.startswith(f"config file {tmp_path / 'c.yaml'}: not valid YAML: unacceptable")


@pytest.mark.parametrize(("text", "key", "line"), [
    # The second section replaced the first whole: window_max 16 was silently dropped.
    ("admission:\n  window_max: 16\nworkers: [http://a:1]\nadmission:\n  window_min: 2\n",
     "'admission'", 4),
    ("server:\n  port: 9000\n  port: 9001\n", "'port'", 3),
])
def test_a_key_given_twice_is_an_error(tmp_path: Path, text: str, key: str, line: int) -> None:
    msg = _error(tmp_path, text)
    assert f"found the key {key} twice" in msg and f"line {line}," in msg


def test_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  <<: {port: 9000, host: 0.0.0.0}\n  port: 9001\n")
    cfg = load_config(p, environ={})
    assert (cfg.server.port, cfg.server.host) == (9001, "0.0.0.0")


def test_our_own_checks_read_as_written(tmp_path: Path) -> None:
    # Before: "workers.0.url: Value error, worker url must start with http:// or https://, got
    # 'h:1' (got 'h:1')", and a whole section after a check that names its keys.
    msg = _error(tmp_path, "workers: ['h:1']\nadmission:\n  window_min: 50\n  window_max: 10\n")
    assert "  workers.0.url: worker url must start with http:// or https://, got 'h:1'\n" in msg
    assert msg.endswith("  admission: need window_min ≤ window_init ≤ window_max,"
                        " got 50 ≤ 30 ≤ 10")
    assert "Value error" not in msg and "'enabled'" not in msg


@pytest.mark.parametrize("text", [
    # Before: the store section, its redis_url and password in it, was printed back.
    "store:\n  redis_url: 'redis://:hunter2@h:6379'\n  heartbeat_interval_s: 9\n",
    "store:\n  redis_url: 'http://:hunter2@h:6379'\n",
    "telemetry:\n  redis_stream:\n    url: 'http://:hunter2@h:6379'\n",
    "auth:\n  admin_token: [hunter2]\n",
])
def test_a_refused_value_never_prints_a_credential(tmp_path: Path, text: str) -> None:
    msg = _error(tmp_path, text)
    assert "hunter2" not in msg and "invalid configuration" in msg
