#!/usr/bin/env bash
# Produce the GPU figures of docs/results/h200/ on one CUDA machine, each with its command.
#
#   scripts/gpu_results.sh <out-dir> <wheel-dir> <job> [<job> ...]
#
# Jobs (each bounded by its own timeout, its log and JSON under <out-dir>/<job>/):
#   step      gefen-bench step: GPT-2- and Llama-3.2-1B-shaped bf16 sets, this project's
#             Gefen (factored default and block), AdamW fused/foreach, torch Muon + AdamW, both
#             GefenMuonHybrids, and the published gefen-x 0.5.0 / gefen 1.2.3 from wheels
#   train     gefen-bench train --preset h200-small with the peers brought as wheels
# Environment overrides: STEP_MODELS, STEP_OPTIMIZERS, STEP_TIMEOUT; TRAIN_STEPS, TRAIN_JOBS
# (parallel runs on the one GPU: throughput is then shared), TRAIN_TIMEOUT.
#   resume    gefen-bench resume on CUDA, bf16, fused kernels, the three recipes
#   megatron  the Megatron-Core GPT smoke (three recipes, checkpoint continuation)
#   savepeak  DCP save peak with and without GefenSavePlanner (32 tensors, CUDA)
# <wheel-dir> holds the published gefen / gefen-x wheels, torchao, bitsandbytes, and the
# engines from scripts/gpu_wheelhouse.sh in <wheel-dir>/ds. The packages of this checkout are
# imported from the source tree (PYTHONPATH), as scripts/run_gpu_tests.sh does.
set -uo pipefail

out="${1:?usage: gpu_results.sh <out-dir> <wheel-dir> <job>...}"
wheels="${2:?usage: gpu_results.sh <out-dir> <wheel-dir> <job>...}"
shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
PYTHONPATH="$(ls -d "$ROOT"/packages/*/src | tr '\n' :)$ROOT/scripts"
export PYTHONPATH
mkdir -p "$out"
peers="$(mktemp -d)"
trap 'rm -rf "$peers"' EXIT

# The published packages both import as `gefen`: each lives in its own --target directory.
"$PY" -m pip install --quiet --no-index --no-deps --target "$peers/gx" "$wheels"/gefen_x-0.5.0-*.whl
"$PY" -m pip install --quiet --no-index --no-deps --target "$peers/g12" "$wheels"/gefen-1.2.3-*.whl
# Peers and engines go to a private --target directory too, not the interpreter's
# site-packages, so anything else running on the machine (e.g. the release gate) is unaffected.
"$PY" -m pip install --quiet --no-index --no-deps --target "$peers/site" \
  "$wheels"/torchao-*.whl "$wheels"/bitsandbytes-*.whl "$wheels"/ds/*.whl
PYTHONPATH="$PYTHONPATH:$peers/site"
targets=(--target "gefen-x=$peers/gx" --target "gefen=$peers/g12")

run() {  # run <job> <timeout-s> <command...>: log to <out>/<job>/<job>.log, report the status
  local job="$1" limit="$2"
  shift 2
  mkdir -p "$out/$job"
  local start=$SECONDS
  (cd "$ROOT" && timeout "$limit" "$@") > "$out/$job/$job.log" 2>&1
  local rc=$?
  echo "$job: exit $rc in $((SECONDS - start)) s"
  { echo; echo "command: $*"; echo "exit $rc in $((SECONDS - start)) s"; } >> "$out/$job/$job.log"
}

for job in "$@"; do
  case "$job" in
    step)
      run step "${STEP_TIMEOUT:-420}" "$PY" -m gefen_bench.cli step \
        --models "${STEP_MODELS:-gpt2,llama}" \
        --optimizers "${STEP_OPTIMIZERS:-gefen,gefen-blockv,adamw-fused,adamw-foreach,muon,gefen-muon-hybrid,gefen-muon-hybrid-adamw,gefenx-0.5,gefen-1.2}" \
        "${targets[@]}" --steps 50 --timeout 200 --out "$out/step" ;;
    train)
      run train "${TRAIN_TIMEOUT:-560}" "$PY" -m gefen_bench.cli train --preset h200-small \
        --tasks lm --steps "${TRAIN_STEPS:-300}" --jobs "${TRAIN_JOBS:-3}" --timeout 400 \
        "${targets[@]}" \
        --optimizers gefen,adamw,adafactor,muon,gefen-muon-hybrid-adamw,gefen-muon-hybrid,torchao-adamw8bit,torchao-adamw4bit,bnb-adamw8bit,gefenx-0.5 \
        --out "$out/train" ;;
    resume)
      run resume "${RESUME_TIMEOUT:-300}" "$PY" -m gefen_bench.cli resume --device cuda --bf16 --out "$out/resume/resume.json" ;;
    megatron)
      run megatron "${MEGATRON_TIMEOUT:-300}" "$PY" packages/gefen-dist/benchmarks/megatron_gpt_smoke.py --out "$out/megatron" ;;
    savepeak)
      run savepeak "${SAVEPEAK_TIMEOUT:-300}" "$PY" packages/gefen-dist/benchmarks/dcp_save_peak.py --device cuda --tensors 32 ;;
    *) echo "gpu_results.sh: unknown job $job" >&2; exit 2 ;;
  esac
done
