#!/usr/bin/env bash
# The local GPU release gate: the exact built wheels, the mandatory GPU list, zero skips.
#
#   scripts/release_gpu_gate.sh <artifacts-dir> [--single-gpu] [--parallel] [--out DIR]
#
# <artifacts-dir> is what `nox -s build` wrote (dist/: five wheels, five sdists, SHA256SUMS),
# copied to the GPU machine. The gate
#   1. verifies every artifact against SHA256SUMS;
#   2. makes a fresh venv with --system-site-packages (the machine's CUDA torch, triton and
#      test libraries, also when they live in a venv; the machine has no network) and
#      installs the five wheels into it,
#      --no-deps --no-index (extra wheels, e.g. deepspeed, may be carried in
#      $GEFEN_GATE_EXTRA_WHEELS);
#   3. checks the installed set (scripts/check_installed.py);
#   4. runs scripts/run_gpu_tests.sh --installed on the tests/ of the unpacked sdists, so the
#      tests are the released ones and the code is the installed wheels;
#   5. writes <out>/gpu-gate-summary.json: verdict, wheel sha256, test counts per package,
#      GPU names, versions, who signed it off ($GEFEN_RELEASE_MANAGER), and prints the
#      summary's own sha256 for the PyPI approval.
# --single-gpu: runs everything but the two-GPU tests, reports those as not run, and the
# verdict is "fail" (exit 3) whatever else passed. --parallel: the packages' GPU suites run at
# once (see scripts/run_gpu_tests.sh). Exit 0 only when the full gate passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
artifacts=""
single=()
parallel=()
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --single-gpu) single=(--single-gpu) ;;
    --parallel) parallel=(--parallel) ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "release_gpu_gate.sh: unknown option $1" >&2; exit 2 ;;
    *) artifacts="$1" ;;
  esac
  shift
done
[[ -n "$artifacts" && -f "$artifacts/SHA256SUMS" ]] || {
  echo "usage: release_gpu_gate.sh <artifacts-dir with SHA256SUMS> [--single-gpu] [--out DIR]" >&2; exit 2; }
artifacts="$(cd "$artifacts" && pwd)"
out="${out:-$PWD/gpu-gate}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

echo "--- 1. artifacts"
(cd "$artifacts" && sha256sum --check --strict SHA256SUMS) || { echo "artifacts do not match SHA256SUMS" >&2; exit 1; }

echo "--- 2. fresh venv with the exact wheels"
"$PYTHON" -m venv --system-site-packages "$work/venv" || exit 2
venv_python="$work/venv/bin/python"
# --system-site-packages reaches the *base* interpreter's site-packages only: when $PYTHON is
# itself a venv (GPU images often ship torch in one), its site-packages are appended by a .pth
# file, after the new venv's own (so the wheels installed below take precedence).
parent_site="$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')"
if [[ -n "$parent_site" ]]; then
  child_site="$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$parent_site" > "$child_site/_gefen_gate_parent_site.pth"
fi
wheels=("$artifacts"/*.whl)
extra=()
if [[ -n "${GEFEN_GATE_EXTRA_WHEELS:-}" ]]; then extra=("$GEFEN_GATE_EXTRA_WHEELS"/*.whl); fi
PIP_CONFIG_FILE=/dev/null "$venv_python" -m pip install --quiet --no-index --no-deps \
  --force-reinstall "${wheels[@]}" "${extra[@]}" || exit 1

echo "--- 3. installed set"
(cd "$work" && "$venv_python" "$ROOT/scripts/check_installed.py" --allow-prerelease \
  --expect gefen-x gefen-bench gefen-dist gefen-core gefen-kernels) || exit 1

echo "--- 4. GPU list on the installed wheels"
mkdir -p "$work/tests"
for sdist in "$artifacts"/*.tar.gz; do
  base="$(basename "$sdist" .tar.gz)"          # e.g. gefen_core-0.1.0
  dist="${base%-*}"; dist="${dist//_/-}"       # -> gefen-core
  mkdir -p "$work/tests/$dist"
  tar -xzf "$sdist" -C "$work/tests/$dist" --strip-components=1
done
PYTHON="$venv_python" bash "$ROOT/scripts/run_gpu_tests.sh" --installed "${single[@]}" "${parallel[@]}" \
  --tests-root "$work/tests" --report-dir "$out/reports"
rc=$?

echo "--- 5. summary"
"$venv_python" - "$artifacts" "$out" "$rc" "${#single[@]}" "$(( $(date +%s) - started ))" <<'PY'
import datetime, hashlib, json, os, platform, socket, subprocess, sys
from importlib import metadata
from pathlib import Path

import torch

artifacts, out, rc, single, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
reports = {p.stem: json.loads(p.read_text()) for p in sorted((out / "reports").glob("*.json"))}
not_run = reports.pop("multigpu-not-run", {}).get("multigpu_not_run")
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.split()[0]
except Exception:
    driver = None
verdict = "pass" if rc == 0 and not single else "fail"
summary = {
    "gate": "gefen-x local GPU release gate",
    "verdict": verdict,
    "mode": "single-gpu dry run" if single else "full",
    "exit_status": rc,
    "reason": {0: "all mandatory GPU tests passed", 1: "a mandatory GPU test failed or was skipped",
               2: "environment error", 3: "single-GPU part passed; multi-GPU part NOT RUN"}.get(rc),
    "multigpu_not_run": not_run,
    "artifacts": {line.split()[1]: line.split()[0] for line in (artifacts / "SHA256SUMS").read_text().splitlines()},
    "tests": reports,
    "totals": {k: sum(r.get(k, 0) for r in reports.values()) for k in ("passed", "failed", "skipped", "xfailed", "errors")},
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "triton": version("triton"), "nvidia_driver": driver,
                 **{n: version(n) for n in ("gefen-x", "gefen-core", "gefen-kernels", "gefen-dist", "gefen-bench", "deepspeed", "megatron-core", "transformers")}},
    "host": socket.gethostname(),
    "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "wall_s": seconds,
    "signed_off_by": os.environ.get("GEFEN_RELEASE_MANAGER", "unsigned"),
}
path = out / "gpu-gate-summary.json"
path.write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({k: summary[k] for k in ("verdict", "mode", "reason", "totals", "gpus")}, indent=2))
print(f"summary: {path}\nsummary sha256: {hashlib.sha256(path.read_bytes()).hexdigest()}")
PY
exit $rc
