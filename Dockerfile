# BucketServe image: the code, its dependencies and Ray, for every node of a Ray cluster (KubeRay runs its own
# `ray start` in it). Build from the repository root:
#
#   CPU (default):  docker build -t bucketserve:latest .
#   NVIDIA CUDA:    docker build -t bucketserve:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 .
#                   (the wheel carries the CUDA runtime; the nodes need the NVIDIA driver and container toolkit)
#   Intel Gaudi:    docker build -t bucketserve:gaudi --build-arg TORCH_INDEX=base \
#                     --build-arg BASE_IMAGE=vault.habana.ai/gaudi-docker/<SynapseAI>/ubuntu24.04/habanalabs/pytorch-installer-<torch>:latest .
#                   (TORCH_INDEX=base keeps the base image's torch and habana_frameworks.torch: a torch from PyPI
#                   would replace the one built for Gaudi. The base image's Python must be 3.11 or newer.)
#
# Build arguments:
#   BASE_IMAGE     the image to start from (default python:3.11-slim-bookworm)
#   TORCH_INDEX    the pip index torch==TORCH_VERSION comes from, or "base" to keep the base image's torch
#   TORCH_VERSION  the torch release installed from TORCH_INDEX (default 2.13.0, the one the code is tested with)
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# g++: the CPU paged-attention kernel is compiled at install; wget: KubeRay's own probes of the Ray processes;
# openssl: making the KV endpoint's certificate (README, "Deploying on a Ray cluster / KubeRay").
RUN if command -v apt-get >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ make wget openssl \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/bucketserve
COPY . .

# torch first and alone, pinned, so that no other package pulls another build of it.
RUN if [ "$TORCH_INDEX" = base ]; then \
        python -c "import torch; print('keeping the base image torch', torch.__version__)" \
        && python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
        && pip install -r /tmp/requirements.txt \
        && pip install --no-deps -e . ; \
    else \
        pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" \
        && pip install -e . ; \
    fi \
    && python -m engine.kernels.build

EXPOSE 8000
CMD ["bucketserve", "serve", "--host", "0.0.0.0"]
