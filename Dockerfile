# syntax=docker/dockerfile:1
#
# The rlrec image: one image for the policy, consumer and trainer services (docker-compose.yml).
#
#   docker build -t rlrec .                        # CPU (default): torch from the PyTorch CPU index
#   docker run --rm rlrec --help                   # the entrypoint is the `rlrec` CLI
#
# GPU variant: the same Dockerfile with torch from a CUDA index. The CUDA wheels bundle the CUDA
# runtime, so python:3.11-slim stays the base; the host needs an NVIDIA driver and the NVIDIA
# Container Toolkit, and the container needs `--gpus all` (compose: a device reservation, see
# docs/DEPLOY.md). Pick a CUDA build that PyTorch publishes for this torch version:
#
#   docker build -t rlrec:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   rlrec train ... --num-gpus-per-learner 1
#
# Only the trainer uses a GPU; policies and consumers run on the CPU image.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned, from PyTorch's own index: a plain `pip install torch` from PyPI would
# pull several GB of CUDA packages into a CPU image. The extras below then find it installed.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/rlrec
# Project metadata and sources only (see .dockerignore): a change in tests/ or docs/ keeps the cache.
COPY pyproject.toml setup.py README.md ./
# The five folders are installed as one package, rlrec (rlrec.producer, rlrec.store, ...).
COPY producer ./producer
COPY store ./store
COPY consumer ./consumer
COPY trainer ./trainer
COPY rlrec ./rlrec

# trainer = consumer + torch (the consumer extra has ray[data,rllib], pyarrow, boto3, ...).
# The policy side alone needs no extra; add `local` for the embedded broker/S3 or `all` for tests.
# rlrec is pure Python: no C compiler is needed.
ARG EXTRAS=trainer
RUN pip install ".[${EXTRAS}]" && rlrec --help >/dev/null

# Not root. HOME is where Ray keeps its session files (/tmp/ray) and pip/ray caches go.
RUN useradd --create-home --uid 1000 rlrec \
    && mkdir -p /keys /pubkey && chown rlrec:rlrec /keys /pubkey && chmod 700 /keys
# /keys and /pubkey: mount points of the compose volumes for the policy-signing key pair (a new
# named volume takes the owner of its mount point, so the unprivileged user can write the keys)
USER rlrec
WORKDIR /home/rlrec

ENTRYPOINT ["rlrec"]
CMD ["--help"]
