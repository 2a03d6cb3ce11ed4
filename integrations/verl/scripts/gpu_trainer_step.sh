#!/usr/bin/env bash
# One full verl training step with crl's compaction_gae on one CUDA GPU (issue 59): verl 0.9.1's own v1 trainer
# (python -m verl.trainer.main_ppo) with crl_verl's trainer hook, critic, and compacting agent loop on the memory-chain
# example (integrations/verl/examples/), vLLM sampling. NOT RUN YET: written and config-checked on a CPU machine
# (tests/test_verl_trainer_config.py composes these overrides with verl's config and builds the trainer); a CPU
# machine lacks the GPUs verl's Ray resource pools require and a GPU rollout server (docs/verl.md).
#
#   integrations/verl/scripts/gpu_trainer_step.sh MODEL_DIR [OUT_DIR]
#     MODEL_DIR: a local Hugging Face checkpoint with a chat template (e.g. checkpoints/smollm2-135m-instruct, made by
#                `make train-lm` or scripts/import_checkpoint.py smollm2-135m-instruct --out ...)
#     OUT_DIR:   default runs/verl_gpu_step (datasets, verl's checkpoints, log)
# Env: VERL_GPU_VENV (default .venv-verl-gpu): built on first use with verl's own GPU extra (verl[vllm]==0.9.1:
#      CUDA torch 2.11, vLLM 0.24.0), then crl_verl and crl's core (--no-deps), as `make verl` does on CPU.
# Passes when main_ppo exits 0 after trainer.total_training_steps=1 (the log holds verl's step metrics).
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:?usage: $0 MODEL_DIR [OUT_DIR]}
[ -d "$MODEL" ] && MODEL=$(realpath "$MODEL")
OUT=$(realpath -m "${2:-runs/verl_gpu_step}")  # absolute: Ray workers need not share our working directory
VENV=${VERL_GPU_VENV:-.venv-verl-gpu}
PY=$VENV/bin/python
if [ ! -x "$PY" ] || ! "$PY" -c "import crl_verl, vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$PY" -m pip install "verl[vllm]==0.9.1"
  "$PY" -m pip install -e integrations/verl
  "$PY" -m pip install --no-deps -e .
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to ' + sys.executable)"
"$PY" -c "import crl_verl; crl_verl.check_environment()"
mkdir -p "$OUT"
"$PY" integrations/verl/examples/make_memory_dataset.py "$OUT/data"
# the example agent-loop config with its env_factory file made absolute
AGENT_LOOP=$OUT/compaction_agent_loop.yaml
sed "s#integrations/verl/examples/memory_env.py#$PWD/integrations/verl/examples/memory_env.py#" \
  integrations/verl/examples/compaction_agent_loop.yaml > "$AGENT_LOOP"
args=()
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  line=${line//\{MODEL\}/$MODEL}
  line=${line//\{AGENT_LOOP\}/$AGENT_LOOP}
  args+=("${line//\{OUT\}/$OUT}")
done < integrations/verl/examples/trainer_step.overrides
export WANDB_MODE=disabled
"$PY" -m verl.trainer.main_ppo "${args[@]}" 2>&1 | tee "$OUT/main_ppo.log"
