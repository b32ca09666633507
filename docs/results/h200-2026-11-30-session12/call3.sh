#!/bin/bash
# Call 3 (two H200s; run again on one after the argument-order fix: call4): the period-score ops after review: gradients on a device other than the
# current one, exact block counts; the period-score tests compiled, and gefen-core's period tests.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call3_tests.log
(cd packages/gefen-kernels && timeout 250 python3 -m pytest tests/ops/test_period_scores.py -q -p gefen_pytest_gates -rs >> $OUT/call3_tests.log 2>&1; echo EXIT $? >> $OUT/call3_tests.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_period.py -q -p gefen_pytest_gates -n 8 >> $OUT/call3_tests.log 2>&1; echo EXIT $? >> $OUT/call3_tests.log)
tail -n 20 $OUT/call3_tests.log
