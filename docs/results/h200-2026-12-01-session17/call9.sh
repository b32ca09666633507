#!/bin/bash
# Session 17, call 9: the tests added after calls 7 and 8 (commits 86387f2, e65e430) on the
# GPU: gefen-kernels' factored-step, step-groups and block-step files, whole.
set -x
cd .gpu/tree/packages/gefen-kernels
export PYTHONPATH=$(ls -d $PWD/../*/src | tr '\n' ':')$PWD/../../scripts
timeout 300 python3 -m pytest tests/ops/test_factored_step.py tests/ops/test_step_groups.py \
    tests/ops/test_block_step.py -q -p gefen_pytest_gates -n 8 > $OUT/call9_tests.log 2>&1
echo "EXIT $?" >> $OUT/call9_tests.log
tail -n 5 $OUT/call9_tests.log
grep -E "^FAILED|^ERROR" $OUT/call9_tests.log | head
