# marsproxy image: `marsproxy serve` as the entrypoint; config from a mounted file
# (MARSPROXY_CONFIG=/etc/marsproxy/marsproxy.yaml) and MARSPROXY_* environment variables.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY marsproxy ./marsproxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin marsproxy
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY configs/marsproxy.yaml /etc/marsproxy/marsproxy.yaml
ENV MARSPROXY_CONFIG=/etc/marsproxy/marsproxy.yaml \
    MARSPROXY_SERVER__HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"
ENTRYPOINT ["marsproxy", "serve"]
