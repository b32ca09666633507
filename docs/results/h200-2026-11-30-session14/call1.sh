#!/bin/bash
# Call 1: the step benchmark's CUDA-graph rows (HEAD), GPT-2 with the thirteenth session's
# head-and-tail kernels (.gpu/tail = gefen-kernels src of ebd51ac) under graph replay, and the
# first step's phases. HEAD snapshot in .gpu/tree.
set -x
cd .gpu/tree
NEW=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
TAIL=$PWD/../tail/packages/gefen-kernels/src:$NEW
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call1_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
export PYTHONPATH=$NEW
(cd packages/gefen-bench && timeout 150 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates > $OUT/call1_bench_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call1_bench_gpu_tests.log)
tail -n 3 $OUT/call1_bench_gpu_tests.log >> $L
timeout 120 python3 scripts/first_step_phases.py --models gpt2,llama > $OUT/call1_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
G=gefen-graph,gefen-blockv-graph,adamw-fused-graph
timeout 200 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,$G --steps 50 --timeout 90 --out /tmp/head > /tmp/head.log 2>&1; echo "head EXIT $?" >> $L
cp /tmp/head/step.json $OUT/call1_step_head.json
for v in tail head2 tail2; do
  if [ ${v%2} = tail ]; then P=$TAIL; else P=$NEW; fi
  PYTHONPATH=$P timeout 70 python3 -m gefen_bench.cli step --models gpt2 --optimizers gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 --timeout 60 --out /tmp/$v > /tmp/$v.log 2>&1; echo "$v EXIT $?" >> $L
  cp /tmp/$v/step.json $OUT/call1_step_$v.json
done
tail -n 30 /tmp/head.log >> $L
cat $L
cat $OUT/call1_first_step_phases.txt
python3 - <<'PY'
import json, os
for v in ("head", "tail", "head2", "tail2"):
    try:
        d = json.load(open(f"{os.environ['OUT']}/call1_step_{v}.json"))
    except OSError as e:
        print(v, e); continue
    print(v, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(v, r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "peak", r["peak_extra_mib"])
PY
