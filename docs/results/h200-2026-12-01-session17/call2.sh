#!/bin/bash
# Session 17, call 2: the TMA tile kernel with its tables hoisted out of the block loop and
# with plain stores (tma_tile_probe.py --hoist, --tma-store).
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/tma_tile_probe.py --stages 2,3 --per-sm 2,4 --warps 4,8 --hoist 0,1 \
    --tma-store 0,1 > $OUT/call2_probe.txt 2>&1
cat $OUT/call2_probe.txt
