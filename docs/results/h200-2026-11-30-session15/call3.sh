#!/bin/bash
# Call 3: the first step's finiteness check as one multi-tensor inf-norm per (device, dtype).
# Its CUDA test (every non-finite value found, any position and dtype), gefen-core's GPU and
# edge-case tests, and the first step by phase.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call3_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_edge_cases.py tests/test_gefen_gpu.py tests/test_hybrid.py -q -p gefen_pytest_gates -n 4 > $OUT/call3_tests.log 2>&1; echo "core EXIT $?" >> $OUT/call3_tests.log)
grep -E "passed|failed|EXIT" $OUT/call3_tests.log >> $L
timeout 200 python3 scripts/first_step_phases.py --models gpt2,llama --repeats 3 --kernels 12 > $OUT/call3_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
cat $L
grep -v "^\.\|Warning\|warner" $OUT/call3_tests.log | tail -n 8
grep -A11 "===" $OUT/call3_first_step_phases.txt | head -26
