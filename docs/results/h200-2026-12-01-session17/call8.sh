#!/bin/bash
# Session 17, call 8: the step benchmark of the final tree (all rows, GPT-2 and Llama shapes),
# and one steady GPT-2 step's kernels (profile_step.py --launches, factored only).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call8_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
timeout 360 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,adamw-foreach,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 --timeout 120 --out /tmp/s8 > /tmp/s8.log 2>&1; echo "step EXIT $?" >> $L
cp /tmp/s8/step.json $OUT/call8_step.json; cp /tmp/s8/step.png $OUT/step.png
timeout 100 python3 scripts/profile_step.py --models gpt2 --modes factored --launches --steps 10 > $OUT/call8_profile_gpt2.txt 2>&1; echo "profile EXIT $?" >> $L
cat $L
awk '/one steady step/{f=1} /--- parameters/{f=0} f' $OUT/call8_profile_gpt2.txt
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/call8_step.json"))
print("failed:", d.get("failed"), "copy", d.get("copy_bandwidth"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "p90", round(r["step_ms_p90"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1), "B/param", round(r["state_bytes_per_param"], 3), "peak", round(r["peak_extra_mib"], 2), "first transient", round(r["first_step_transient_mib"], 2), "%copy", round(r["pct_copy_bw"], 1))
PY
