#!/bin/bash
# Call 2: capturable steps in grouped launches (scalars and seeds assembled on the device).
# GPU tests of the changed code, then the step benchmark with the CUDA-graph rows, twice.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call2_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py -q -p gefen_pytest_gates -n 4 > $OUT/call2_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call2_core_gpu_tests.log) &
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests/ops/test_step_groups.py tests/ops/test_step_plan.py -m gpu -q -p gefen_pytest_gates -n 4 > $OUT/call2_kernels_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call2_kernels_gpu_tests.log) &
wait
(cd packages/gefen-bench && timeout 150 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 4 >> $OUT/call2_core_gpu_tests.log 2>&1; echo "bench EXIT $?" >> $OUT/call2_core_gpu_tests.log)
tail -n 3 $OUT/call2_kernels_gpu_tests.log >> $L
tail -n 6 $OUT/call2_core_gpu_tests.log >> $L
for i in 1 2; do
  timeout 200 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 --timeout 90 --out /tmp/s$i > /tmp/s$i.log 2>&1; echo "step $i EXIT $?" >> $L
  cp /tmp/s$i/step.json $OUT/call2_step_$i.json
done
tail -n 22 /tmp/s1.log >> $L
cat $L
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call2_step_{i}.json"))
    print(i, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(i, r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "peak", r["peak_extra_mib"])
PY
