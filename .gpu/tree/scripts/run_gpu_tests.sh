#!/usr/bin/env bash
# Run the mandatory GPU test list (release/gpu-test-list.txt) with zero-skip enforcement.
#
#   scripts/run_gpu_tests.sh [--single-gpu] [--installed] [--parallel] [--tests-root DIR]
#                            [--report-dir DIR]
#
# For the accelerator machine, which has no network and no nox: it needs only python3 with
# torch (CUDA), pytest and the packages' test dependencies. By default the packages are
# imported from the source tree (PYTHONPATH = packages/*/src, no install). With --installed
# they must come from site-packages instead (the release gate installs the built wheels) and
# --tests-root points at the unpacked sdists (<root>/<distribution>/tests).
#
# Every test marked `gpu` or `multigpu` runs; a skip, an xfail or a listed package that
# selects no test is a failure. --single-gpu runs `gpu and not multigpu` and then reports
# the multi-GPU part as NOT RUN, which is a failure (exit 3) by design: a one-GPU machine can
# dry-run the gate but never pass it. Exit: 0 all passed; 1 a test failed or skipped;
# 2 usage or environment error; 3 single-GPU part passed, multi-GPU part not run.
# --parallel runs the packages' suites at once (one process each, same GPUs; logs are printed
# in list order when all are done). Per-package JSON counts go to --report-dir (default: a temporary directory); what passing
# tests print (e.g. the DeepSpeed offload-vs-no-offload loss curves) is shown (-rP).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
single_gpu=0
installed=0
parallel=0
tests_root="$ROOT/packages"
report_dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --single-gpu) single_gpu=1 ;;
    --installed) installed=1 ;;
    --tests-root) tests_root="$2"; shift ;;
    --report-dir) report_dir="$2"; shift ;;
    --parallel) parallel=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "run_gpu_tests.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
report_dir="${report_dir:-$(mktemp -d)}"
mkdir -p "$report_dir"

# NVLink multicast stays off on the lent machines (their notes say why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET

mapfile -t packages < <(grep -v '^\s*#' "$ROOT/release/gpu-test-list.txt" | grep -v '^\s*$')
pythonpath="$ROOT/scripts"
if [[ $installed -eq 0 ]]; then
  for pkg in "$ROOT"/packages/*/src; do pythonpath="$pythonpath:$pkg"; done
fi

gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')" || {
  echo "run_gpu_tests.sh: $PYTHON cannot import torch" >&2; exit 2; }
if [[ "$gpus" -lt 1 ]]; then
  echo "run_gpu_tests.sh: no CUDA GPU visible; the GPU list cannot run here (a failure, not a skip)" >&2
  exit 2
fi
if [[ $single_gpu -eq 0 && "$gpus" -lt 2 ]]; then
  echo "run_gpu_tests.sh: the full list needs 2 GPUs, found $gpus; use --single-gpu for a dry run" >&2
  exit 2
fi
marker="gpu or multigpu"
[[ $single_gpu -eq 1 ]] && marker="gpu and not multigpu"
echo "GPU list: ${packages[*]} | marker: $marker | GPUs: $gpus | python: $PYTHON"

run_package() {  # run_package <pkg>: its GPU tests; prints the log, returns pytest's status
  local pkg="$1" dir="$tests_root/$1" extra=() start rc
  [[ -d "$dir/tests" ]] || { echo "missing $dir/tests" >&2; return 1; }
  [[ $installed -eq 1 ]] && extra+=(--gefen-require-installed)
  echo "=== $pkg"
  start=$(date +%s)
  (cd "$dir" && PYTHONPATH="$pythonpath" "$PYTHON" -m pytest tests -ra -rP -q -m "$marker" \
      -p gefen_pytest_gates --gefen-fail-on-skip --gefen-summary "$report_dir/$pkg.json" \
      -o timeout=1800 --strict-markers -p no:cacheprovider "${extra[@]}")
  rc=$?
  echo "=== $pkg: exit $rc in $(( $(date +%s) - start )) s"
  return $rc
}

status=0
if [[ $parallel -eq 1 ]]; then
  # One process per package on the same GPU(s): the tests assert results, not timings, and
  # memory statistics are per process, so only the wall time changes.
  for pkg in "${packages[@]}"; do
    (run_package "$pkg" > "$report_dir/$pkg.log" 2>&1; echo $? > "$report_dir/$pkg.rc") &
  done
  wait
  for pkg in "${packages[@]}"; do
    cat "$report_dir/$pkg.log"
    [[ "$(cat "$report_dir/$pkg.rc" 2>/dev/null)" == 0 ]] || status=1
  done
else
  for pkg in "${packages[@]}"; do
    run_package "$pkg" || status=1
  done
fi

if [[ $single_gpu -eq 1 ]]; then
  not_run=0
  for pkg in "${packages[@]}"; do
    n=$(cd "$tests_root/$pkg" && PYTHONPATH="$pythonpath" "$PYTHON" -m pytest tests -q \
          --collect-only -m multigpu -p no:cacheprovider 2>/dev/null | grep -c '::')
    not_run=$(( not_run + n ))
  done
  echo "{\"multigpu_not_run\": $not_run}" > "$report_dir/multigpu-not-run.json"
  echo "MULTI-GPU PART NOT RUN: $not_run test(s) need two GPUs; the gate cannot pass on one GPU."
  [[ $status -eq 0 ]] && status=3
fi
exit $status
