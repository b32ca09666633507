#!/bin/bash
# Session 20, call 3: call 2's instruction counts of one steady factored step again, with the
# GPU's clock left free (call 2 let Nsight Compute lock it to the base clock), and the split
# probe with Nsight Compute's counts of its kernels (call 2's files of these did not come back).
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
M=smsp__inst_executed.sum,gpu__time_duration.sum,smsp__cycles_elapsed.avg.per_second
for model in llama gpt2; do
    timeout 200 $NCU --clock-control none --profile-from-start off --csv --metrics $M \
        python scripts/step_instructions.py --model $model > $OUT/call3_inst_$model.csv 2> /tmp/e
    echo "== $model (exit $?)"; tail -2 /tmp/e
    python scripts/step_instructions.py --summarize $OUT/call3_inst_$model.csv --model $model
done
timeout 200 $NCU --clock-control none --csv --metrics $M \
    -k regex:"_step_tile_kernel|_quant_kernel|_update_kernel" -c 12 \
    python scripts/split_step_probe.py --ncu > $OUT/call3_probe_ncu.csv 2> /tmp/e
echo "== probe ncu (exit $?)"; tail -2 /tmp/e
grep -E "smsp__inst_executed" $OUT/call3_probe_ncu.csv | cut -d, -f5,9,10,16-
python scripts/split_step_probe.py > $OUT/call3_probe.txt 2>&1
cat $OUT/call3_probe.txt
