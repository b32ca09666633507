#!/bin/bash
# Call 1: the codebook DP as one launch per layer (many programs, each row's whole Knuth
# window). GPU tests of the DP and of the CUDA codebook, the solver's time, the first step by
# phase with the kernels' device time (torch.profiler), and the step benchmark's first step.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call1_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_quantizer_dp.py -q -p gefen_pytest_gates > $OUT/call1_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call1_tests.log) &
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_codebook.py tests/test_gefen_gpu.py -m gpu -q -p gefen_pytest_gates -n 3 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
wait
cat /tmp/core.log >> $OUT/call1_tests.log
tail -n 4 $OUT/call1_tests.log >> $L
timeout 120 python3 -m gefen_bench.cli codebook --repeats 7 > $OUT/call1_codebook.txt 2>&1; echo "codebook EXIT $?" >> $L
timeout 200 python3 scripts/first_step_phases.py --models gpt2,llama --kernels 40 > $OUT/call1_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
timeout 150 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-graph,adamw-fused --steps 50 --timeout 70 --out /tmp/s1 > /tmp/s1.log 2>&1; echo "step EXIT $?" >> $L
cp /tmp/s1/step.json $OUT/call1_step.json
cat $L
grep -v "^\.\|Warning\|warner" $OUT/call1_tests.log | tail -n 15
tail -n 12 $OUT/call1_codebook.txt
grep -A14 "===" $OUT/call1_first_step_phases.txt | head -40
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/call1_step.json"))
print("failed:", d.get("failed"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "first peak", r["first_step_peak_extra_mib"], "transient", r["first_step_transient_mib"])
PY
