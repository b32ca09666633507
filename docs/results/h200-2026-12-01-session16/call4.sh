#!/bin/bash
# Call 4: the factored tile route's per-block row statistic and vector column loads (IN_ROW)
# in production. The whole gefen-kernels suite and gefen-core's GPU tests; the kernel
# ablation against the two changes of this session (flat_k: per-element statistics;
# head_lookup: the head word from global memory); the step benchmark twice (all rows, then
# the Gefen rows and fused AdamW).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call4_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
(cd packages/gefen-kernels && timeout 400 python3 -m pytest tests -q -p gefen_pytest_gates -n 10 > $OUT/call4_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call4_tests.log) &
(cd packages/gefen-core && timeout 400 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 3 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
wait
cat /tmp/core.log >> $OUT/call4_tests.log
grep -hE "passed|failed|EXIT" $OUT/call4_tests.log >> $L
timeout 200 python3 scripts/kernel_ablation.py --no-periods --variants base,flat_k,head_lookup,base_again > $OUT/call4_ablation.txt 2>&1; echo "ablation EXIT $?" >> $L
timeout 330 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,adamw-foreach,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 --timeout 120 --out /tmp/s4_1 > /tmp/s4_1.log 2>&1; echo "step 1 EXIT $?" >> $L
cp /tmp/s4_1/step.json $OUT/call4_step_1.json; cp /tmp/s4_1/step.png $OUT/step.png
timeout 200 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,adamw-fused,gefen-graph,gefen-blockv-graph --steps 50 --timeout 90 --out /tmp/s4_2 > /tmp/s4_2.log 2>&1; echo "step 2 EXIT $?" >> $L
cp /tmp/s4_2/step.json $OUT/call4_step_2.json
cat $L
grep -E "^FAILED|^ERROR" $OUT/call4_tests.log | head
tail -n 18 $OUT/call4_ablation.txt
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call4_step_{i}.json"))
    print("run", i, "failed:", d.get("failed"), "copy", d.get("copy_bandwidth"))
    for r in d["rows"]:
        print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1), "B/param", round(r["state_bytes_per_param"], 3), "peak", r["peak_extra_mib"], "first peak", r["first_step_peak_extra_mib"])
PY
