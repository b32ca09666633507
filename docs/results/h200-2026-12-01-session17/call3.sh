#!/bin/bash
# Session 17, call 3: where the production tile kernel's time goes now (after the staged lookup
# and IN_ROW): stage ablations, and an Nsight Compute profile with per-instruction samples.
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python scripts/kernel_ablation.py --no-periods --periods 2048 \
    --variants base,no_search,no_cb_gather,no_gathers,fast_sigma,no_div,all_ablations,base_again \
    > $OUT/call3_ablation.txt 2>&1
cat $OUT/call3_ablation.txt
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --clock-control none --set full --import-source yes -k regex:_step_tile_kernel -c 2 \
    -o /tmp/tile python scripts/kernel_ablation.py --ncu > /tmp/ncu.log 2>&1
tail -3 /tmp/ncu.log
$NCU --import /tmp/tile.ncu-rep --page details > $OUT/call3_ncu_tile.txt
$NCU --import /tmp/tile.ncu-rep --page source --csv --print-source sass | gzip > $OUT/call3_ncu_source.csv.gz
python scripts/ncu_stall_summary.py $OUT/call3_ncu_source.csv.gz > $OUT/call3_ncu_stalls.txt
cat $OUT/call3_ncu_stalls.txt
grep -E "Duration|Registers Per|Theoretical Occ|Achieved Occ|DRAM Throughput|L1/TEX Cache Throughput|Compute \(SM\)|Executed Ipc Active|Issue Slots Busy" $OUT/call3_ncu_tile.txt
