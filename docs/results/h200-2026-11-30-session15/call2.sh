#!/bin/bash
# Call 2: Variant L scores only the candidates its rules read, and the search kernel skips the
# p = 1 term's second fp64 log where p = 1 is not scored. GPU tests of the period scores, the
# period search and the codebook, the first step by phase with the kernels' device time, and
# the step benchmark (first step and steady rows), twice.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call2_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests/ops/test_period_scores.py tests/ops/test_quantizer_dp.py -q -p gefen_pytest_gates -n 4 > $OUT/call2_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call2_tests.log) &
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_period.py tests/test_codebook.py tests/test_gefen_gpu.py -q -p gefen_pytest_gates -n 4 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
wait
cat /tmp/core.log >> $OUT/call2_tests.log
grep -E "passed|failed|EXIT" $OUT/call2_tests.log >> $L
timeout 200 python3 scripts/first_step_phases.py --models gpt2,llama --kernels 25 > $OUT/call2_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
for i in 1 2; do
timeout 170 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,gefen-graph,gefen-blockv-graph,adamw-fused --steps 50 --timeout 70 --out /tmp/s2_$i > /tmp/s2_$i.log 2>&1; echo "step $i EXIT $?" >> $L
cp /tmp/s2_$i/step.json $OUT/call2_step_$i.json
done
cat $L
grep -v "^\.\|Warning\|warner" $OUT/call2_tests.log | tail -n 12
grep -A12 "===" $OUT/call2_first_step_phases.txt | head -30
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call2_step_{i}.json"))
    print("run", i, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "first peak", round(r["first_step_peak_extra_mib"], 1), "steady peak", round(r.get("peak_extra_mib", -1), 1))
PY
