# syntax=docker/dockerfile:1
# The serving image: CUDA 13 runtime, vLLM 0.32.0 (CUDA build), the bonsai_vllm plugin and bonsai-fetch.
# compose.yaml runs it twice: once as the model-fetch init container, once as the vLLM server.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ---- build: a virtual environment with everything, copied whole into the final stage -------------------
FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# vLLM's CUDA build; xxhash because --prefix-caching-hash-algo xxhash fails at start-up without it.
RUN pip install vllm==0.32.0 xxhash==3.6.0
COPY plugin /src/plugin
COPY model-fetch /src/model-fetch
# bonsai's vLLM patches (--kv-cache-dtype k3v2): the script the Makefile's venv recipe runs, then the plugin.
RUN python /src/plugin/patches/apply.py \
 && pip install /src/plugin /src/model-fetch

# ---- final: runtime only ----------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# gcc and libc6-dev stay on purpose: Triton compiles each kernel's small C launcher at run time, and
# vLLM's (and our) Triton kernels fail to load without a C compiler. curl is for the healthcheck.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 gcc libc6-dev curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 bonsai \
 && mkdir -p /models /cache/huggingface /cache/triton \
 && chown -R bonsai:bonsai /models /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    VLLM_WSL2_ENABLE_PIN_MEMORY=1
# The numeric id of the bonsai user created above (resolvable on any host).
USER 1000:1000
WORKDIR /home/bonsai
EXPOSE 8000
# The first start compiles kernels and CUDA graphs for several minutes: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["bonsai-serve"]
