# syntax=docker/dockerfile:1
# marsproxy image: `marsproxy serve` as the entrypoint (non-root, HEALTHCHECK on /healthz).
# Config: a mounted file at $MARSPROXY_CONFIG (default /etc/marsproxy/marsproxy.yaml) and
# MARSPROXY_* variables (MARSPROXY_WORKERS='[http://vllm:8000]', MARSPROXY_SERVER__PORT=...),
# which override the file. The same image runs the emulated worker:
#   docker run --entrypoint marsproxy IMAGE emulate --host 0.0.0.0 --port 8000
#
#   docker build -t marsproxy:local .
#   docker run --rm -p 8080:8080 -v $PWD/deploy/compose/marsproxy.yaml:/etc/marsproxy/marsproxy.yaml:ro \
#     marsproxy:local

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: a wheel of marsproxy (package data included: sample trace, py.typed, Redis Lua
#    scripts under marsproxy/aimd/stores/, policy presets under marsproxy/data/policies/),
#    installed with its dependencies and the `fast` extra (uvloop) into /opt/venv.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY marsproxy ./marsproxy
# The asserts fail the build when the installed wheel lacks package data the proxy reads at
# run time (-I: the installed package, not the sources in the working directory).
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && WHEEL="$(ls /wheels/marsproxy-*.whl)" \
 && /opt/venv/bin/pip install "${WHEEL}[fast]" \
 && /opt/venv/bin/python -I -c "import glob, os, importlib.resources as r, uvloop, marsproxy; \
from marsproxy.policies import policy_names; \
assert marsproxy.__file__.startswith('/opt/venv/'), marsproxy.__file__; \
lua = {os.path.basename(f) for f in glob.glob('/src/marsproxy/aimd/stores/*.lua')}; \
got = {f.name for f in r.files('marsproxy.aimd.stores').iterdir()}; \
assert lua and lua <= got, f'Lua scripts missing: {lua - got}'; \
want = {os.path.basename(f)[:-5] for f in glob.glob('/src/marsproxy/data/policies/*.yaml')}; \
assert want and want <= set(policy_names()), f'policy presets missing: {want - set(policy_names())}'"

# -- runtime: the venv only; no compiler, no pip cache, no sources.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="marsproxy" \
      org.opencontainers.image.description="Admission-control reverse proxy for coding agents on vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --system --uid 10001 --gid 0 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin marsproxy
COPY --from=build /opt/venv /opt/venv
# An empty config: a file with every key set would pin them against the policy presets.
COPY deploy/image/marsproxy.yaml /etc/marsproxy/marsproxy.yaml
ENV PATH=/opt/venv/bin:$PATH \
    MARSPROXY_CONFIG=/etc/marsproxy/marsproxy.yaml \
    MARSPROXY_SERVER__HOST=0.0.0.0 \
    MARSPROXY_SERVER__PORT=8080 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
EXPOSE 8080
# Follows MARSPROXY_SERVER__PORT; /healthz answers while the process serves (use /readyz, which
# needs a healthy worker, for load-balancer readiness).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MARSPROXY_SERVER__PORT', '8080'), timeout=2)"]
# marsproxy handles SIGTERM itself (drains in-flight requests for server.drain_timeout_s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["marsproxy", "serve"]
