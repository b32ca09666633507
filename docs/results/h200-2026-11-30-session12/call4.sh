#!/bin/bash
# Call 4 (one H200): call 3 again after the argument-order fix of multi_period_scores_triton.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call4_tests.log
(cd packages/gefen-kernels && timeout 250 python3 -m pytest tests/ops/test_period_scores.py -q -p gefen_pytest_gates -rs >> $OUT/call4_tests.log 2>&1; echo EXIT $? >> $OUT/call4_tests.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_period.py -q -p gefen_pytest_gates -n 8 >> $OUT/call4_tests.log 2>&1; echo EXIT $? >> $OUT/call4_tests.log)
tail -n 20 $OUT/call4_tests.log
