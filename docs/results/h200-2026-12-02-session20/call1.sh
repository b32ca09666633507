#!/bin/bash
# Session 20, call 1: the factored step split into a quantising tile pass and a flat update
# pass (scripts/split_step_probe.py): times interleaved against production's statistics pass
# and tile kernel, bit-identity checks, and an Nsight Compute summary of the kernels.
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/split_step_probe.py > $OUT/call1_probe.txt 2>&1
cat $OUT/call1_probe.txt
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 240 $NCU --clock-control none --section SpeedOfLight --section Occupancy \
    --section InstructionStats --section LaunchStats --section WarpStateStats \
    -k regex:"_step_tile_kernel|_quant_kernel|_update_kernel" -c 6 \
    -o /tmp/split python scripts/split_step_probe.py --ncu > /tmp/ncu.log 2>&1
tail -3 /tmp/ncu.log
$NCU --import /tmp/split.ncu-rep --page details > $OUT/call1_ncu.txt
grep -E "^  [_a-z]|Duration|Registers Per|Theoretical Occ|Achieved Occ|DRAM Throughput|Compute \(SM\)|Executed Ipc Active|Issue Slots Busy|Executed Instructions  " $OUT/call1_ncu.txt
