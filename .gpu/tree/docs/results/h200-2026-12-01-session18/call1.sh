#!/bin/bash
# Session 18, call 1: the side stream for small launch classes (commit 0324640).
# 1. kernel_ablation at P = 1152 and 1280 (bf16 [8190, 8192]): two head-and-tail blocks per
#    program (tail_bpp2, 8 and 4 warps) against production, interleaved;
# 2. test_step_groups.py whole on the GPU, then its two side-stream tests against a tree with
#    the final wait removed and one with the first wait removed (each must fail);
# 3. gefen-bench step on GPT-2 shapes, the tree before (.gpu/old) and after (.gpu/tree),
#    old/new/old/new in one call, and the profile of one steady GPT-2 step after.
set -x
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call1_bench.log
cd $ROOT/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $L
timeout 120 python3 scripts/kernel_ablation.py --no-periods --rows 8190 --periods 1152,1280 \
    --variants base,tail_bpp2,tail_bpp2_w4,base_again --rounds 5 --reps 20 > $OUT/call1_ablation.txt 2>&1
echo "ablation EXIT $?" >> $L
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -n 4 > $OUT/call1_tests.log 2>&1; echo "step_groups EXIT $?" >> $OUT/call1_tests.log)
for mut in end start; do
  rm -rf /tmp/mut && cp -r $ROOT/tree /tmp/mut
  f=/tmp/mut/packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py
  if [ $mut = end ]; then sed -i 's/^            current.wait_stream(stream)  # type.*$/            pass/' $f
  else sed -i 's/^            stream.wait_stream(current)  # type.*$/            pass/' $f; fi
  echo "mutation $mut: $(diff $ROOT/tree/packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py $f | wc -l) diff lines" >> $OUT/call1_tests.log
  (cd /tmp/mut/packages/gefen-kernels && PYTHONPATH=$(ls -d /tmp/mut/packages/*/src | tr '\n' ':') timeout 120 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -k "side_stream" >> $OUT/call1_tests.log 2>&1; echo "mutation $mut EXIT $? (1 expected)" >> $OUT/call1_tests.log)
done
grep -hE "passed|failed|EXIT|mutation" $OUT/call1_tests.log >> $L
for run in old1 new1 old2 new2; do
  tree=tree; [ "${run:0:3}" = old ] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 120 python3 -m gefen_bench.cli step \
      --models gpt2 --optimizers gefen,adamw-fused,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 \
      --timeout 90 --out /tmp/ab_$run > /tmp/ab_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/ab_$run/step.json $OUT/call1_step_$run.json
done
cd $ROOT/tree
timeout 100 python3 scripts/profile_step.py --models gpt2 --modes factored --launches --steps 10 > $OUT/call1_profile_gpt2.txt 2>&1; echo "profile EXIT $?" >> $L
cat $L
grep -E "^FAILED|^ERROR" $OUT/call1_tests.log | head
grep -v "^  " $OUT/call1_ablation.txt | tail -n 14
awk '/one steady step/{f=1} /--- parameters/{f=0} f' $OUT/call1_profile_gpt2.txt
python3 - <<'PY'
import json, os
for run in ("old1", "new1", "old2", "new2"):
    d = json.load(open(f"{os.environ['OUT']}/call1_step_{run}.json"))
    print(run, "failed:", d.get("failed"), {r["optimizer"]: (round(r["step_ms_median"], 3), round(r["peak_extra_mib"], 2)) for r in d["rows"]})
PY
