#!/bin/bash
# Session 19, call 2: the final tree. The step benchmark (all rows, GPT-2 and Llama shapes,
# one run), then the gefen-kernels suite whole (gefen-core's GPU tests ran in call 1).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call2_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
timeout 330 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,adamw-foreach,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 --timeout 120 --out /tmp/s2 > /tmp/s2.log 2>&1; echo "step EXIT $?" >> $L
cp /tmp/s2/step.json $OUT/call2_step.json; cp /tmp/s2/step.png $OUT/step.png
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests -q -p gefen_pytest_gates -n 10 > $OUT/call2_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call2_tests.log)
grep -hE "passed|failed|EXIT" $OUT/call2_tests.log >> $L
cat $L
grep -E "^FAILED|^ERROR" $OUT/call2_tests.log | head
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/call2_step.json"))
print("failed:", d.get("failed"), "copy", d.get("copy_bandwidth"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "p90", round(r["step_ms_p90"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1), "B/param", round(r["state_bytes_per_param"], 3), "peak", round(r["peak_extra_mib"], 2), "first transient", round(r["first_step_transient_mib"], 2), "%copy", round(r["pct_copy_bw"], 1))
PY
