#!/bin/bash
# Call 1b (diagnostic, between calls 1 and 2): which scale element differed in call 1's two
# failing tests, with the staged lookup and with the head-word lookup forced, three times;
# then the two tests twice. Run from the snapshot of commit 88e9d3b with call1b_nan_debug.py
# beside the tree (.gpu/nan_debug.py). The output came back only as the call's printed tail:
# call1b_output.txt is that text, copied.
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
for i in 1 2 3; do python3 ../nan_debug.py 2>&1 | tail -6; done
cd packages/gefen-kernels && for i in 1 2; do timeout 120 python3 -m pytest tests/ops/test_factored_step.py tests/ops/test_block_step.py -q -p gefen_pytest_gates -k "zero_rows_columns_hyper_and_nan or non_finite_and_zero_blocks" 2>&1 | grep -E "passed|failed|differ|^E " | head -8; done
