#!/bin/bash
# Session 19, call 5: is call 2's captured Llama first step (256.8 ms against 95.3 in session
# 18's call 3) the code's or the run's? Session 18's call 3 tree (.gpu/old, commit be15c58)
# against this session's (.gpu/tree), old/new twice, Llama, gefen and gefen-graph only.
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call5_bench.log
for run in old1 new1 old2 new2; do
  tree=tree; [ "${run:0:3}" = old ] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 140 python3 -m gefen_bench.cli step \
      --models llama --optimizers gefen,gefen-graph --steps 20 --timeout 120 --out /tmp/f_$run > /tmp/f_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/f_$run/step.json $OUT/call5_step_$run.json
done
cat $L
python3 - <<'PY'
import json, os
for run in ("old1", "new1", "old2", "new2"):
    try:
        d = json.load(open(f"{os.environ['OUT']}/call5_step_{run}.json"))
    except OSError:
        continue
    print(run, {r["optimizer"]: ("first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1), "step", round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3)) for r in d["rows"]})
PY
