# vLLM with kvguard installed next to it, in the same Python environment.
# kvguard 0.1.0 supports vLLM 0.32.0-0.34.0: the base image's tag must be in
# kvguard[vllm]'s range (pyproject.toml), and the kvguard version below is pyproject.toml's:
# tests/deploy/test_docker.py checks both.
#
# Build from the repository root (the context is the checkout; .dockerignore keeps it
# to kvguard's own sources):
#   docker build -f deploy/docker/engine.Dockerfile -t <registry>/vllm-kvguard:0.32.0 .
# This project's CI has no container runtime: it lints this file with hadolint and
# checks its contract, it never builds it (deploy/README.md, "Container images").

# kvguard is not on PyPI: its wheel is built from the checkout.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvguard ./kvguard
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM vllm/vllm-openai:v0.32.0
COPY --from=wheel /dist/ /tmp/kvguard-dist/
# --no-index: each supported vLLM already depends on everything kvguard needs
# (tests/test_install.py), so nothing of vLLM's environment changes; with a vLLM outside
# kvguard[vllm]'s range in the base image, this step fails instead of replacing it.
RUN pip install --no-cache-dir --no-index --find-links=/tmp/kvguard-dist "kvguard[vllm]==0.1.0" \
    && rm -rf /tmp/kvguard-dist \
    && python3 -c "from importlib.metadata import entry_points as e; assert 'kvguard' in e(group='vllm.general_plugins').names"
# VLLM_PLUGINS: load kvguard's general plugin (list your other plugins too, comma-separated).
# KVGUARD_RUN_DIR: where each engine core writes <engine>.json; mount the volume the
# sidecar reads here.
ENV VLLM_PLUGINS=kvguard \
    KVGUARD_RUN_DIR=/run/kvguard
# The base image's entry point stays: `vllm serve <model> ...`.
