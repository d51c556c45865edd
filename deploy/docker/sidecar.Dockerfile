# The kvguard sidecar: reads the engines' state files from the shared run directory and
# serves /metrics, /healthz, /v1/report and /v1/checkpoints. No vLLM, no torch, no GPU.
#
# Build from the repository root:
#   docker build -f deploy/docker/sidecar.Dockerfile -t <registry>/kvguard:0.1.0 .
# This project's CI has no container runtime: it lints this file with hadolint and
# checks its contract, it never builds it (deploy/README.md, "Container images").

# kvguard is not on PyPI: its wheel is built from the checkout.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvguard ./kvguard
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.12-slim
# The wheel by path (never a "kvguard" from an index); its dependencies (pydantic,
# prometheus-client, FastAPI, uvicorn, pyzmq, msgspec) at the versions CI tests (scripts/constraints.txt).
COPY scripts/constraints.txt /tmp/constraints.txt
COPY --from=wheel /dist/ /tmp/kvguard-dist/
RUN pip install --no-cache-dir --constraint /tmp/constraints.txt /tmp/kvguard-dist/kvguard-*.whl \
    && rm -rf /tmp/kvguard-dist /tmp/constraints.txt \
    && install -d -m 0700 -o 1000 -g 1000 /run/kvguard
ENV KVGUARD_RUN_DIR=/run/kvguard \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so that Kubernetes' runAsNonRoot can verify it; the same UID as the engine
# (its state files are mode 0600).
USER 1000:1000
EXPOSE 9400
# Exits non-zero unless /healthz answers 200 (port: KVGUARD_SIDECAR_PORT, default 9400).
# Kubernetes ignores HEALTHCHECK: the manifest probes GET /healthz itself.
HEALTHCHECK --interval=15s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVGUARD_SIDECAR_PORT', '9400'), timeout=2)"]
ENTRYPOINT ["kvguard", "sidecar"]
# A container's loopback is unreachable from outside it: listen on every interface of
# the container's own network namespace. Set KVGUARD_CONTROL_TOKEN, or POST
# /v1/checkpoints is open to whoever reaches the port.
CMD ["--host=0.0.0.0"]
