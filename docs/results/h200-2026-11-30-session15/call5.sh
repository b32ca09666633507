#!/bin/bash
# Call 5: after the review fixes (the per-tensor period carry's p = 1 program only when p = 1
# is scored). GPU tests of the period scores, the DP and the histogram; the first step by
# phase, also after torch.cuda.empty_cache() (the allocator's cudaMalloc calls paid again).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call5_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 300 python3 -m pytest tests/ops/test_period_scores.py tests/ops/test_quantizer_dp.py tests/ops/test_histogram.py -q -p gefen_pytest_gates -n 4 > $OUT/call5_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call5_tests.log)
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_period.py tests/test_gefen_gpu.py -q -p gefen_pytest_gates -n 4 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
cat /tmp/core.log >> $OUT/call5_tests.log
grep -E "passed|failed|EXIT" $OUT/call5_tests.log >> $L
timeout 240 python3 scripts/first_step_phases.py --models gpt2,llama --repeats 3 > $OUT/call5_first_step_phases.txt 2>&1; echo "phases EXIT $?" >> $L
cat $L
grep -v "^\.\|Warning\|warner" $OUT/call5_tests.log | tail -n 8
grep -A12 "===" $OUT/call5_first_step_phases.txt | head -30
