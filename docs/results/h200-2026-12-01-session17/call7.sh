#!/bin/bash
# Session 17, call 7: the head-and-tail tile (commit 6b91646) on the H200.
# 1. kernel_ablation at periods just above 1024 (bf16 [8190, 8192]): production (a tail up to
#    5 P2 / 8) against one_tile (no tail) and any_tail (a tail up to 3 P2 / 4);
# 2. the whole gefen-kernels suite and gefen-core's GPU tests;
# 3. gefen-bench step on GPT-2 shapes, the tree before the change (.gpu/old) and after
#    (.gpu/tree), alternating old/new/old/new in one call.
set -x
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call7_bench.log
cd $ROOT/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
timeout 150 python3 scripts/kernel_ablation.py --no-periods --rows 8190 --periods 1040,1152,1280,1344,1536 \
    --variants base,one_tile,any_tail,base_again --rounds 5 --reps 20 > $OUT/call7_ablation.txt 2>&1
echo "ablation EXIT $?" >> $L
(cd packages/gefen-kernels && timeout 300 python3 -m pytest tests -q -p gefen_pytest_gates -n 10 > $OUT/call7_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/call7_tests.log)
(cd packages/gefen-core && timeout 200 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 3 > /tmp/core.log 2>&1; echo "core EXIT $?" >> /tmp/core.log)
cat /tmp/core.log >> $OUT/call7_tests.log
grep -hE "passed|failed|EXIT" $OUT/call7_tests.log >> $L
for run in old1 new1 old2 new2; do
  tree=tree; [ "${run:0:3}" = old ] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 120 python3 -m gefen_bench.cli step \
      --models gpt2 --optimizers gefen,adamw-fused,gefen-graph,adamw-fused-graph --steps 50 \
      --timeout 90 --out /tmp/ab_$run > /tmp/ab_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/ab_$run/step.json $OUT/call7_step_$run.json
done
cat $L
grep -E "^FAILED|^ERROR" $OUT/call7_tests.log | head
grep -v "^  " $OUT/call7_ablation.txt | tail -n 24
python3 - <<'PY'
import json, os
for run in ("old1", "new1", "old2", "new2"):
    d = json.load(open(f"{os.environ['OUT']}/call7_step_{run}.json"))
    print(run, "failed:", d.get("failed"), {r["optimizer"]: round(r["step_ms_median"], 3) for r in d["rows"]})
PY
