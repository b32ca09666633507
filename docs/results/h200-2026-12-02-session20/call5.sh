#!/bin/bash
# Session 20, call 5: the flat update route against the tree before it (.gpu/old, 70c2e52),
# old/new twice, GPT-2 (whose factored classes with blocks across rows take the route), then
# the final tree's full step benchmark (both models, all rows).
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call5_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
for run in old1 new1 old2 new2; do
  tree=tree; [ "${run:0:3}" = old ] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 90 python3 -m gefen_bench.cli step \
      --models gpt2 --optimizers gefen,gefen-graph,adamw-fused --steps 50 --timeout 70 --out /tmp/f_$run > /tmp/f_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/f_$run/step.json $OUT/call5_step_$run.json
done
cd $ROOT/tree
PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 230 python3 -m gefen_bench.cli step --models gpt2,llama \
    --optimizers gefen,gefen-blockv,adamw-fused,gefen-graph,gefen-blockv-graph,adamw-fused-graph \
    --steps 50 --timeout 120 --out /tmp/s5 > /tmp/s5.log 2>&1; echo "step final EXIT $?" >> $L
cp /tmp/s5/step.json $OUT/call5_step.json; cp /tmp/s5/step.png $OUT/step.png
cat $L
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for run in ("old1", "new1", "old2", "new2"):
    try:
        d = json.load(open(f"{out}/call5_step_{run}.json"))
    except OSError:
        continue
    print(run, {r["optimizer"]: (round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3)) for r in d["rows"]})
d = json.load(open(f"{out}/call5_step.json"))
print("failed:", d.get("failed"), "copy", d.get("copy_bandwidth"))
for r in d["rows"]:
    print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "p90", round(r["step_ms_p90"], 3), "host", round(r["host_issue_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1), "B/param", round(r["state_bytes_per_param"], 3), "peak", round(r["peak_extra_mib"], 2), "%copy", round(r["pct_copy_bw"], 1))
PY
