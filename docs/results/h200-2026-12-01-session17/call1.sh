#!/bin/bash
# Session 17, call 1: the persistent TMA tile kernel against production (tma_tile_probe.py).
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/tma_tile_probe.py --stages 1,2,3 --per-sm 1,2,4 --warps 4,8 > $OUT/call1_probe.txt 2>&1
tail -5 $OUT/call1_probe.txt
