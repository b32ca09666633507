#!/bin/bash
# Call 3: candidate k_rows of kernel_ablation.py (factored tile route: one row statistic per
# block and the column statistics as 16-byte vector loads) against production, bit-identical
# check included.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
timeout 200 python3 scripts/kernel_ablation.py --no-periods --variants base,k_rows,base_again,k_rows > $OUT/call3_ablation.txt 2>&1; echo "ablation EXIT $?" >> $OUT/call3_ablation.txt
tail -n 20 $OUT/call3_ablation.txt
