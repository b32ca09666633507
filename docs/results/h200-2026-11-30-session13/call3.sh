#!/bin/bash
# Call 3: every public op and a Gefen model on cuda:1 while cuda:0 is current
# (on_tensor_device; these multigpu cases skip on one GPU), with the whole kernels GPU suite
# and gefen-core's GPU files. Two H200s were not lent this session: it ran on one.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call3_tests.log
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests -m "gpu or multigpu" -q -p gefen_pytest_gates -n 6 -rA > /tmp/k.log 2>&1; echo EXIT $? >> /tmp/k.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py -q -p gefen_pytest_gates -n 3 -rA > /tmp/c.log 2>&1; echo EXIT $? >> /tmp/c.log)
(echo "--- gefen-kernels -m 'gpu or multigpu'"; cat /tmp/k.log; echo "--- gefen-core GPU files"; cat /tmp/c.log) >> $OUT/call3_tests.log
grep -E "passed|failed|EXIT|other_device|FAILED" $OUT/call3_tests.log | tail -30
