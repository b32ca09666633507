#!/bin/bash
# Session 20, call 4: the flat update route (FLAT_UPDATE) on the GPU: the gefen-kernels suite
# whole (its new test compares the route with the fused tile bit for bit; test_step_groups'
# classes include two FLAT_UPDATE classes, eager, staged and captured), and gefen-core's GPU
# tests.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call4_summary.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
(cd packages/gefen-kernels && timeout 300 python3 -m pytest tests -q -p gefen_pytest_gates -n 10 > $OUT/call4_kernels.log 2>&1; echo "kernels EXIT $?" >> $OUT/call4_kernels.log)
(cd packages/gefen-kernels && timeout 120 python3 -m pytest tests/ops/test_step_plan.py tests/ops/test_step_groups.py -q -p gefen_pytest_gates --gefen-fail-on-skip -n 4 > $OUT/call4_flat.log 2>&1; echo "flat EXIT $?" >> $OUT/call4_flat.log)
(cd packages/gefen-core && timeout 120 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 3 > $OUT/call4_core.log 2>&1; echo "core EXIT $?" >> $OUT/call4_core.log)
grep -hE "passed|failed|EXIT" $OUT/call4_kernels.log $OUT/call4_flat.log $OUT/call4_core.log >> $L
cat $L
grep -hE "^FAILED|^ERROR" $OUT/call4_*.log | head -20
