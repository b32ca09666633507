#!/bin/bash
# Session 17, call 4: each kernel of one steady step, GPT-2 and Llama shapes, both modes
# (profile_step.py --launches), for where the step's device time goes outside the tile kernel.
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/profile_step.py --models gpt2,llama --launches --steps 10 > $OUT/call4_profile.txt 2>&1
grep -A200 "one steady step" $OUT/call4_profile.txt | grep -v "^  .*_tile_kernel\b" | head -150
