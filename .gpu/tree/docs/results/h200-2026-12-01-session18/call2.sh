#!/bin/bash
# Session 18, call 2: large chunks on two streams (CHAIN_STREAMS = 2, 6 MiB chunks).
# 1. test_step_groups.py whole on the GPU, then the ordering test against trees with the
#    chain stream's final or first wait removed (each must fail);
# 2. gefen-bench step, the tree with the side stream only (.gpu/old, commit 0324640) against
#    this one (.gpu/tree): GPT-2 old/new/old/new, Llama old/new.
set -x
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call2_bench.log
cd $ROOT/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -n 4 > $OUT/call2_tests.log 2>&1; echo "step_groups EXIT $?" >> $OUT/call2_tests.log)
for mut in end start; do
  rm -rf /tmp/mut && cp -r $ROOT/tree /tmp/mut
  f=/tmp/mut/packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py
  if [ $mut = end ]; then sed -i 's/^            main.wait_stream(chain)$/            pass/' $f
  else sed -i 's/^            chain.wait_stream(main)$/            pass/' $f; fi
  echo "mutation chain $mut: $(diff $ROOT/tree/packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py $f | wc -l) diff lines" >> $OUT/call2_tests.log
  (cd /tmp/mut/packages/gefen-kernels && PYTHONPATH=$(ls -d /tmp/mut/packages/*/src | tr '\n' ':') timeout 120 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -k "ordered" >> $OUT/call2_tests.log 2>&1; echo "mutation chain $mut EXIT $? (1 expected)" >> $OUT/call2_tests.log)
done
grep -hE "passed|failed|EXIT|mutation" $OUT/call2_tests.log >> $L
for run in gpt2-old1 gpt2-new1 gpt2-old2 gpt2-new2 llama-old1 llama-new1; do
  tree=tree; [[ $run == *old* ]] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 150 python3 -m gefen_bench.cli step \
      --models ${run%%-*} --optimizers gefen,adamw-fused,gefen-graph,gefen-blockv-graph,adamw-fused-graph --steps 50 \
      --timeout 120 --out /tmp/ab_$run > /tmp/ab_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/ab_$run/step.json $OUT/call2_step_$run.json
done
cat $L
grep -E "^FAILED|^ERROR" $OUT/call2_tests.log | head
python3 - <<'PY'
import json, os
for run in ("gpt2-old1", "gpt2-new1", "gpt2-old2", "gpt2-new2", "llama-old1", "llama-new1"):
    d = json.load(open(f"{os.environ['OUT']}/call2_step_{run}.json"))
    print(run, "failed:", d.get("failed"), {r["optimizer"]: (round(r["step_ms_median"], 3), round(r["peak_extra_mib"], 2)) for r in d["rows"]})
PY
