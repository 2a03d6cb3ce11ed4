#!/usr/bin/env bash
# GPU check (issue 12): on a machine with one CUDA GPU and the project installed (make setup, with a CUDA torch),
# in under 8 minutes:
#   1. pytest -m gpu             generation log-probs = teacher forcing (fp32, bf16), estimator and one PPO
#                                loss+backward on GPU = CPU (tests/test_gpu.py states the tolerances)
#   2. a 3-iteration `accelerate launch --config_file configs/accelerate/gpu_zero2.yaml scripts/train.py` (the
#      config's own warm start: with a 2-step warm start every reward is 0 and the audit rightly fails on zero
#      gradient norms, measured on CPU)
#      on MODEL (a local checkpoint dir, e.g. from scripts/import_checkpoint.py; default: the llama-small preset)
#   3. scripts/audit.py on that run
#   4. with VERL=1 only: one full verl 0.9.1 training step with crl's compaction_gae (crl_verl's trainer hook, critic
#      and compacting agent loop; integrations/verl/scripts/gpu_trainer_step.sh) on VERL_MODEL (a local Hugging Face
#      checkpoint with a chat template; default checkpoints/smollm2-135m-instruct). Its first run builds
#      .venv-verl-gpu with verl[vllm]==0.9.1 (CUDA torch 2.11, vLLM 0.24: a large download). Never run yet
#      (docs/verl.md says what a CPU machine lacks for it).
# One PASS/FAIL line per step and a summary line; exit status 0 only when every step passed.
#
#   scripts/gpu_check.sh [MODEL] [CONFIG]        # CONFIG default: configs/default.yaml (configs/smollm2_records.yaml
#                                                # for the real model once prompt.format is wired)
# Env: PYTHON (default .venv/bin/python, else python), RUN_DIR (default runs/gpu_check), KEEP_LOGS=1, VERL=1 (step 4),
#      VERL_MODEL, VERL_GPU_VENV.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
ACCEL=$(dirname "$PY")/accelerate; [ -x "$ACCEL" ] || ACCEL=accelerate
MODEL=${1:-llama-small}
CONFIG=${2:-configs/default.yaml}
RUN_DIR=${RUN_DIR:-runs/gpu_check}
LOGS=$(mktemp -d -t crl-gpu-check-XXXX)
declare -a RESULTS=()
FAILED=0
T_ALL=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) log="$LOGS/$name.log" rc
  timeout "$limit" "$@" >"$log" 2>&1; rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then
    RESULTS+=("PASS $name (${dt}s)"); echo "PASS $name (${dt}s)"
  else
    FAILED=$((FAILED + 1)); RESULTS+=("FAIL $name (rc=$rc, ${dt}s)")
    echo "FAIL $name (rc=$rc, ${dt}s; last lines of $log:)"; tail -n 15 "$log" | sed 's/^/    /'
  fi
  return $rc
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "FAIL cuda: no CUDA device visible to $PY (torch.cuda.is_available() is False)"
  echo "SUMMARY: FAIL (no GPU; nothing run)"; exit 1
fi
"$PY" -c "import torch, transformers, sys; print(f'gpu: {torch.cuda.get_device_name(0)}; torch {torch.__version__} (cuda {torch.version.cuda}); transformers {transformers.__version__}; python {sys.version.split()[0]}')"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); model: $MODEL; config: $CONFIG; logs: $LOGS"

step pytest_gpu 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider

rm -rf "$RUN_DIR"
export WANDB_MODE=disabled
step train_3_iterations 300 "$ACCEL" launch --config_file configs/accelerate/gpu_zero2.yaml --num_processes 1 \
  scripts/train.py --config "$CONFIG" \
  model.preset="$MODEL" run_dir="$RUN_DIR" train.iterations=3 eval.every=0 eval.episodes=4 \
  checkpoint.every=3 checkpoint.evidence_every=3 logging.progress=false

step audit 120 "$PY" scripts/audit.py "$RUN_DIR"

if [ "${VERL:-0}" = 1 ]; then
  step verl_trainer_step 1800 integrations/verl/scripts/gpu_trainer_step.sh \
    "${VERL_MODEL:-checkpoints/smollm2-135m-instruct}" "$RUN_DIR-verl"
fi

echo "---"
for r in "${RESULTS[@]}"; do echo "$r"; done
TOTAL=$(( $(date +%s) - T_ALL ))
if [ $FAILED -eq 0 ]; then
  echo "SUMMARY: PASS (${#RESULTS[@]} steps, ${TOTAL}s)"; [ "${KEEP_LOGS:-0}" = 1 ] || rm -rf "$LOGS"; exit 0
fi
echo "SUMMARY: FAIL ($FAILED of ${#RESULTS[@]} steps failed, ${TOTAL}s; logs in $LOGS)"; exit 1
