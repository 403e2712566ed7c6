# syntax=docker/dockerfile:1
# The serving image: CUDA 13 runtime, vLLM 0.32.0 (CUDA build), the bonsai_vllm plugin and bonsai-fetch.
# compose.yaml runs it twice: once as the model-fetch init container, once as the vLLM server.
#
# BASE_IMAGE: the CUDA base on the GPU PC. The tests build this same file on a Debian base made locally with
# mmdebstrap (no registry on CI): every package below has the same name on Ubuntu 24.04 and Debian.
#
# Behind a TLS-intercepting proxy (company networks, this project's CI) pip needs that proxy's CA bundle:
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt .
# Without the secret pip uses the image's own CA store.
#
# One stage: the virtual environment (~8.5 GB, vLLM's CUDA wheels) is nearly all of the image, so a build
# stage would save nothing and copying it between stages doubled the build's disk and time.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The Python headers, gcc and libc6-dev stay on purpose: Triton compiles each kernel's small C launcher at
# run time against Python.h, so vLLM's (and our) Triton kernels fail to load without them ("Python.h: No
# such file or directory"). curl is for the healthcheck.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev curl \
        ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# PyTorch and its CUDA 13 libraries first, in a layer of their own (5.2 GB of the venv's 8.5), at the version
# vLLM 0.32.0 pins (its Requires-Dist: torch==2.13.0; tests/images checks the two agree). Why two steps: a
# build commits a RUN step's files by writing them about three more times (the diff, its blob, the new layer),
# so one 8.5 GB step took 34 GB of free disk at its peak and a CI run ran out; as two steps the peak was 25 GB
# (podman 4.3, measured 2026-12-07; docs/dev-notes.md).
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && pip install torch==2.13.0
# vLLM's CUDA build; xxhash because --prefix-caching-hash-algo xxhash fails at start-up without it.
# FlashInfer: vLLM 0.32 pins flashinfer-python 0.7.0.post1, which has no prebuilt-kernel package on PyPI
# (flashinfer-cubin stops at 0.6.13) and would JIT-compile at the first request; vLLM uses its PyTorch
# sampler and its other attention backends instead (full attention is ours with KV=k3v2). docs/bundle.md.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && pip install vllm==0.32.0 xxhash==3.6.0
COPY plugin /src/plugin
COPY model-fetch /src/model-fetch
# bonsai's vLLM patches (--kv-cache-dtype k3v2): the script the Makefile's venv recipe runs, then the plugin.
# /opt/bonsai/patches keeps apply.py: `apply.py --check` tells whether this vLLM tree carries them.
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && python /src/plugin/patches/apply.py \
 && pip install /src/plugin /src/model-fetch \
 && mkdir -p /opt/bonsai && cp -r /src/plugin/patches /opt/bonsai/patches && rm -rf /src
# The model, download and compile caches are volumes in compose; VLLM_CACHE_ROOT holds torch.compile and
# CUDA-graph caches, so a recreated container does not compile again. The Ubuntu base's user 1000 gives way
# to ours.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 bonsai \
 && mkdir -p /models /cache/huggingface /cache/triton /cache/vllm \
 && chown -R bonsai:bonsai /models /cache
ENV HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    VLLM_CACHE_ROOT=/cache/vllm \
    VLLM_WSL2_ENABLE_PIN_MEMORY=1
# The numeric id of the bonsai user created above (resolvable on any host).
USER 1000:1000
WORKDIR /home/bonsai
EXPOSE 8000
# The first start compiles kernels and CUDA graphs for several minutes: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["bonsai-serve"]
