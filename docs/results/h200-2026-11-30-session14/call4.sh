#!/bin/bash
# Call 4: after the review's fixes (captured launch tables kept, bounded salts tables, the
# bench's capture on the parameters' device): the GPU tests of everything this session touched,
# and one more step benchmark of the graph rows.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call4_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py tests/test_codebook.py tests/test_capturable_groups.py -m "gpu or not gpu" -q -p gefen_pytest_gates -n 4 > $OUT/call4_tests.log 2>&1; echo "core EXIT $?" >> $OUT/call4_tests.log) &
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests/ops/test_step_groups.py tests/ops/test_step_plan.py tests/ops/test_quantizer_dp.py -m gpu -q -p gefen_pytest_gates -n 4 > /tmp/k.log 2>&1; echo "kernels EXIT $?" >> /tmp/k.log) &
wait
cat /tmp/k.log >> $OUT/call4_tests.log
(cd packages/gefen-bench && timeout 150 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 4 >> $OUT/call4_tests.log 2>&1; echo "bench EXIT $?" >> $OUT/call4_tests.log)
timeout 150 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen-graph,gefen-blockv-graph,adamw-fused,adamw-fused-graph --steps 50 --timeout 70 --out /tmp/s4 > /tmp/s4.log 2>&1; echo "step EXIT $?" >> $L
cp /tmp/s4/step.json $OUT/call4_step.json
grep -E "passed|failed|EXIT|Error" $OUT/call4_tests.log >> $L
cat $L
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/call4_step.json"))
print("failed:", d.get("failed"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1))
PY
