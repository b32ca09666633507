#!/bin/bash
# Call 1: nearest rounding looked up in shared memory (the decision table's staged section)
# instead of a random global load of its head word. The kernel ablation against the head-word
# lookup (bit-identical check), the GPU tests of the kernels and of Gefen, and the step
# benchmark (which now also times the first step of a second optimizer, kernels loaded).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call1_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
timeout 200 python3 scripts/kernel_ablation.py --no-periods --variants base,head_lookup,base_again,no_search > $OUT/call1_ablation.txt 2>&1; echo "ablation EXIT $?" >> $L
(cd packages/gefen-kernels && timeout 300 python3 -m pytest tests -q -p gefen_pytest_gates -n 4 -x > $OUT/call1_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call1_tests.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py -q -p gefen_pytest_gates -n 4 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
cat /tmp/core.log >> $OUT/call1_tests.log
grep -E "passed|failed|EXIT" $OUT/call1_tests.log >> $L
for i in 1 2; do
timeout 200 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-graph,gefen-blockv-graph,adamw-fused --steps 50 --timeout 90 --out /tmp/s1_$i > /tmp/s1_$i.log 2>&1; echo "step $i EXIT $?" >> $L
cp /tmp/s1_$i/step.json $OUT/call1_step_$i.json
done
cat $L
tail -n 25 $OUT/call1_ablation.txt
grep -v "^\.\|Warning\|warner" $OUT/call1_tests.log | tail -n 15
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call1_step_{i}.json"))
    print("run", i, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1))
PY
