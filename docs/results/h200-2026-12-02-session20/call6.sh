#!/bin/bash
# Session 20, call 6: the GPT-2 ratio's spread. The final tree's GPT-2 step four times
# (captured Gefen against eager and captured fused AdamW, each run its own process).
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
L=$OUT/call6_bench.log
for run in 1 2 3 4; do
  timeout 70 python3 -m gefen_bench.cli step --models gpt2 \
      --optimizers gefen-graph,adamw-fused,adamw-fused-graph --steps 50 --timeout 60 \
      --out /tmp/g_$run > /tmp/g_$run.log 2>&1
  echo "step $run EXIT $?" >> $L
  cp /tmp/g_$run/step.json $OUT/call6_step_$run.json
done
cat $L
python3 - <<'PY'
import json, os
for run in (1, 2, 3, 4):
    try:
        d = json.load(open(f"{os.environ['OUT']}/call6_step_{run}.json"))
    except OSError:
        continue
    ms = {r["optimizer"]: r["step_ms_median"] for r in d["rows"]}
    print(run, {k: round(v, 3) for k, v in ms.items()},
          "ratio vs eager fused", round(ms["gefen-graph"] / ms["adamw-fused"], 3))
PY
