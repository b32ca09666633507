#!/bin/bash
# Call 4: the histogram counted by torch.histc (no host sync) instead of torch.bincount. Its
# GPU tests (exact fp32 counts at the chunk size, no sync under set_sync_debug_mode("error"),
# deterministic algorithms), the first step by phase with the callers of the host's blocking
# reads, and the step benchmark's first step (two runs).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call4_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests/ops/test_histogram.py tests/ops/test_quantizer_dp.py -q -p gefen_pytest_gates -n 4 > $OUT/call4_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call4_tests.log)
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_codebook.py tests/test_gefen_gpu.py tests/test_gefen_edge_cases.py -q -p gefen_pytest_gates -n 4 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
cat /tmp/core.log >> $OUT/call4_tests.log
grep -E "passed|failed|EXIT" $OUT/call4_tests.log >> $L
timeout 200 python3 scripts/first_step_phases.py --models gpt2,llama --repeats 3 --cprofile 25 --callers "tolist|method 'to' of|backend_impl|method 'cpu' of" --kernels 12 > $OUT/call4_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
for i in 1 2; do
timeout 150 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-graph,adamw-fused --steps 50 --timeout 70 --out /tmp/s4_$i > /tmp/s4_$i.log 2>&1; echo "step $i EXIT $?" >> $L
cp /tmp/s4_$i/step.json $OUT/call4_step_$i.json
done
cat $L
grep -v "^\.\|Warning\|warner" $OUT/call4_tests.log | tail -n 12
grep -A11 "===" $OUT/call4_first_step_phases.txt | head -26
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call4_step_{i}.json"))
    print("run", i, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "first", round(r["first_step_ms"], 1), "first peak", round(r["first_step_peak_extra_mib"], 1), "transient", round(r["first_step_transient_mib"], 1))
PY
