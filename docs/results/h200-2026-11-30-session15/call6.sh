#!/bin/bash
# Call 6: the DP layer kernel with its column indices broadcast to the full tile (the floor's
# Triton 3.3 did not compile it). GPU tests of the DP and of the CUDA codebook, and its time.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
L=$OUT/call6_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_quantizer_dp.py -q -p gefen_pytest_gates > $OUT/call6_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call6_tests.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_codebook.py -m gpu -q -p gefen_pytest_gates > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
cat /tmp/core.log >> $OUT/call6_tests.log
grep -E "passed|failed|EXIT" $OUT/call6_tests.log >> $L
timeout 120 python3 -m gefen_bench.cli codebook --repeats 7 > $OUT/call6_codebook.txt 2>&1; echo "codebook EXIT $?" >> $L
cat $L
tail -n 10 $OUT/call6_codebook.txt
