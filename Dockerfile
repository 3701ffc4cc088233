# syntax=docker/dockerfile:1
#
# The rlrec images, two targets of this one Dockerfile (docker-compose.yml builds both):
#
#   docker build -t rlrec .                        # target `full` (the default, last stage): consumer,
#                                                  # trainer and every command; Ray, torch, pyarrow, ...
#   docker build -t rlrec-policy --target policy . # target `policy`: what a deployed policy needs (the
#                                                  # recorder and load_policy from a path or s3://), no Ray
#   docker run --rm rlrec --help                   # the entrypoint is the `rlrec` CLI
#
# Dependencies are installed before the sources are copied: a code change rebuilds only the last
# layers (`pip install --no-deps .`), never Ray or torch.
#
# GPU variant: the same Dockerfile with torch from a CUDA index. The CUDA wheels bundle the CUDA
# runtime, so python:3.11-slim stays the base; the host needs an NVIDIA driver and the NVIDIA
# Container Toolkit, and the container needs `--gpus all` (compose: a device reservation, see
# docs/DEPLOY.md). Pick a CUDA build that PyTorch publishes for this torch version:
#
#   docker build -t rlrec:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   rlrec train ... --num-gpus-per-learner 1
#
# Only the trainer uses a GPU; policies and consumers run on the CPU images.

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------------- base
FROM python:${PYTHON_VERSION}-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Not root. HOME is where Ray keeps its session files (/tmp/ray) and pip/ray caches go.
# /keys and /pubkey: mount points of the compose volumes for the policy-signing key pair (a new
# named volume takes the owner of its mount point, so the unprivileged user can write the keys)
RUN useradd --create-home --uid 1000 rlrec \
    && mkdir -p /keys /pubkey && chown rlrec:rlrec /keys /pubkey && chmod 700 /keys

# torch first and pinned, from PyTorch's own index: a plain `pip install torch` from PyPI would
# pull several GB of CUDA packages into a CPU image. The extras below then find it installed.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/rlrec
# The project's metadata alone; the sources come after the dependencies (see `src`).
COPY pyproject.toml setup.py README.md ./

# ----------------------------------------------------------------------------------------- src
# The five folders, installed as one package, rlrec (rlrec.producer, rlrec.store, ...); only
# metadata and sources (see .dockerignore): a change in tests/ or docs/ keeps the cache.
FROM scratch AS src
COPY producer /src/producer
COPY store /src/store
COPY consumer /src/consumer
COPY trainer /src/trainer
COPY rlrec /src/rlrec

# -------------------------------------------------------------------------------------- policy
# The `policy` extra: torch, safetensors, cryptography and pyarrow (load_policy from s3://),
# on top of the recorder's own dependencies (confluent-kafka, fastavro, numpy, gymnasium).
# The dependencies are installed from pyproject.toml with empty package folders, then that
# placeholder rlrec is uninstalled; the real one comes with the sources, --no-deps.
FROM base AS policy
RUN mkdir -p producer store consumer trainer rlrec/commands rlrec/demo \
    && pip install ".[policy]" && pip uninstall --yes rlrec && rm -rf build *.egg-info
COPY --from=src /src ./
# the checks run from / : in /opt/rlrec, `import rlrec` would find the source folder rlrec/
RUN pip install --no-deps . && cd / && rlrec --help >/dev/null \
    && python -c "import rlrec.producer, rlrec.trainer.policy, rlrec.demo.policy_process, rlrec.commands.record_demo" \
    && ! python -c "import ray" 2>/dev/null
USER rlrec
WORKDIR /home/rlrec
ENTRYPOINT ["rlrec"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------- full
# trainer = consumer + torch (the consumer extra has ray[data,rllib], pyarrow, boto3, ...).
# Add `local` for the embedded broker/S3 or `all` for tests. rlrec is pure Python: no C compiler.
FROM base AS full
ARG EXTRAS=trainer
RUN mkdir -p producer store consumer trainer rlrec/commands rlrec/demo \
    && pip install ".[${EXTRAS}]" && pip uninstall --yes rlrec && rm -rf build *.egg-info
COPY --from=src /src ./
RUN pip install --no-deps . && rlrec --help >/dev/null
USER rlrec
WORKDIR /home/rlrec
ENTRYPOINT ["rlrec"]
CMD ["--help"]
