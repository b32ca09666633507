#!/bin/bash
# Session 17, call 5: the stage ablations again, interleaved (kernel_ablation.py --rounds), and
# the [2048, 8192] tensors with P = 8192 on the loop route against the tile route.
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/kernel_ablation.py --no-periods --periods 2048 --rounds 7 --reps 20 \
    --variants base,no_search,no_cb_gather,no_gathers,fast_sigma,no_div,no_ieee,base_again \
    > $OUT/call5_ablation.txt 2>&1
tail -20 $OUT/call5_ablation.txt
python scripts/kernel_sweep.py --shapes 2048x8192 > $OUT/call5_sweep_loop.txt 2>&1
python scripts/kernel_sweep.py --shapes 2048x8192 --tile-max-period 8192 > $OUT/call5_sweep_tile.txt 2>&1
cat $OUT/call5_sweep_loop.txt $OUT/call5_sweep_tile.txt
