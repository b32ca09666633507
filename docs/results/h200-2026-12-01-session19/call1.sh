#!/bin/bash
# Session 19, call 1: the GPU tests of the stream code in their final form.
# 1. test_step_groups.py whole on the GPU (a skip fails);
# 2. scripts/stream_mutations.py: each planted stream-ordering fault must fail its tests;
# 3. gefen-core's GPU tests.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call1_summary.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates --gefen-fail-on-skip -n 4 > $OUT/call1_step_groups.log 2>&1; echo "step_groups EXIT $?" >> $OUT/call1_step_groups.log)
timeout 300 python3 scripts/stream_mutations.py --out $OUT/call1_mutations.json > /dev/null 2>&1; echo "mutations EXIT $?" >> $L
(cd packages/gefen-core && timeout 100 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 3 > $OUT/call1_core.log 2>&1; echo "core EXIT $?" >> $OUT/call1_core.log)
grep -hE "passed|failed|EXIT" $OUT/call1_step_groups.log $OUT/call1_core.log >> $L
cat $L
cat $OUT/call1_mutations.json
grep -hE "^FAILED|^ERROR" $OUT/call1_*.log | head -20
