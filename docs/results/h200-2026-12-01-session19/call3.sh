#!/bin/bash
# Session 19, call 3: the eager (uncaptured, default) GPT-2 step's host cost before the
# streams of session 18 (.gpu/old, commit 7c4cf39) and with this session's final code
# (.gpu/tree), old/new three times.
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
ROOT=$PWD/.gpu
L=$OUT/call3_bench.log
for run in old1 new1 old2 new2 old3 new3; do
  tree=tree; [ "${run:0:3}" = old ] && tree=old
  cd $ROOT/$tree
  PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts timeout 70 python3 -m gefen_bench.cli step \
      --models gpt2 --optimizers gefen,adamw-fused --steps 50 --timeout 60 --out /tmp/e_$run > /tmp/e_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/e_$run/step.json $OUT/call3_step_$run.json
done
cat $L
python3 - <<'PY'
import json, os
for run in ("old1", "new1", "old2", "new2", "old3", "new3"):
    try:
        d = json.load(open(f"{os.environ['OUT']}/call3_step_{run}.json"))
    except OSError:
        continue
    print(run, {r["optimizer"]: (round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3)) for r in d["rows"]})
PY
