#!/bin/bash
# Session 20, call 2: the split probe again with its ablations (approximate division and
# square root), Nsight Compute's instruction counts of each probe kernel, and of every kernel
# of one steady Gefen step (scripts/step_instructions.py): Llama and GPT-2, factored and block.
set -u
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
M=smsp__inst_executed.sum,gpu__time_duration.sum,smsp__cycles_elapsed.avg.per_second
for cfg in "llama" "llama --block" "gpt2" "gpt2 --block"; do
    set -- $cfg
    tag=$(echo "$cfg" | tr -d ' -')
    timeout 200 $NCU --profile-from-start off --csv --metrics $M \
        python scripts/step_instructions.py --model $cfg > $OUT/call2_inst_$tag.csv 2> /tmp/ncu_$tag.err
    echo "== $cfg (exit $?)"; tail -2 /tmp/ncu_$tag.err
    python scripts/step_instructions.py --summarize $OUT/call2_inst_$tag.csv --model $1 \
        > $OUT/call2_inst_$tag.txt 2>&1
    cat $OUT/call2_inst_$tag.txt
done
timeout 200 $NCU --clock-control none --csv --metrics $M \
    -k regex:"_step_tile_kernel|_quant_kernel|_update_kernel" -c 12 \
    python scripts/split_step_probe.py --ncu > $OUT/call2_probe_ncu.csv 2> /tmp/ncu_probe.err
echo "== probe ncu (exit $?)"; tail -2 /tmp/ncu_probe.err
python scripts/split_step_probe.py > $OUT/call2_probe.txt 2>&1
cat $OUT/call2_probe.txt
