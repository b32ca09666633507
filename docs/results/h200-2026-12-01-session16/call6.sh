#!/bin/bash
# Call 6: COLS16, the factored tile route's alignment hints where blocks cross rows but period
# and column count are multiples of 16 (GPT-2's periods). The step-kernel tests on the GPU
# (a false hint would show there, not in the interpreter), the ablation on [8190, 8192] at
# GPT-2's periods 1536 and 1152 against the kernel without the hints, and GPT-2's step.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call6_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 240 python3 -m pytest tests/ops/test_factored_step.py tests/ops/test_step_groups.py tests/ops/test_step_plan.py tests/ops/test_block_step.py tests/ops/test_multi_block_step.py -q -p gefen_pytest_gates -n 10 > $OUT/call6_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call6_tests.log)
grep -hE "passed|failed|EXIT" $OUT/call6_tests.log >> $L
timeout 150 python3 scripts/kernel_ablation.py --no-periods --rows 8190 --periods 1536,1152 --variants base,no_cols16,base_again,no_cols16 > $OUT/call6_ablation.txt 2>&1; echo "ablation EXIT $?" >> $L
timeout 150 python3 -m gefen_bench.cli step --models gpt2 --optimizers gefen,gefen-graph,adamw-fused --steps 50 --timeout 60 --out /tmp/s6 > /tmp/s6.log 2>&1; echo "step EXIT $?" >> $L
cp /tmp/s6/step.json $OUT/call6_step.json
cat $L
grep -E "^FAILED|^ERROR" $OUT/call6_tests.log | head
tail -n 12 $OUT/call6_ablation.txt
python3 - <<'PY'
import json, os
d = json.load(open(f"{os.environ['OUT']}/call6_step.json"))
print("failed:", d.get("failed"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1))
PY
