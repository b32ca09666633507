#!/bin/bash
# Session 17, call 6: whole blocks packed densely into [chunks, 16] programs against the
# power-of-two tile, at GPT-2's periods (chunk_tile_probe.py).
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/chunk_tile_probe.py --rounds 5 --reps 20 --chunks 128,256,512 > $OUT/call6_chunk_probe.txt 2>&1
cat $OUT/call6_chunk_probe.txt
