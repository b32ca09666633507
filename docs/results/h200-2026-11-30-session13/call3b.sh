#!/bin/bash
# Call 3b (two H200s): the other-device tests of the fixed tree (.gpu/tree), then the same
# tests with the guards removed (.gpu/noguard: on_tensor_device returns the launcher itself,
# histogram_sum without its device context), which must fail.
set -x
ROOT=$PWD
for v in tree noguard; do
  R=$ROOT/.gpu/$v
  cd $R
  export PYTHONPATH=$(ls -d $R/packages/*/src | tr '\n' ':')$R/scripts
  echo "=== $v" >> $OUT/call3b_tests.log
  (cd packages/gefen-kernels && timeout 120 python3 -m pytest tests/ops/test_other_device.py tests/ops/test_period_scores.py -k "other" -q -p gefen_pytest_gates -n 4 -rfE 2>&1 | grep -E "passed|failed|FAILED|Error:" | head -30 >> $OUT/call3b_tests.log)
  (cd packages/gefen-core && timeout 120 python3 -m pytest tests/test_gefen_gpu.py -k "other_than" -q -p gefen_pytest_gates -rfE 2>&1 | grep -E "passed|failed|FAILED|Error:" | head -10 >> $OUT/call3b_tests.log)
done
cat $OUT/call3b_tests.log
