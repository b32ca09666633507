#!/bin/bash
# Call 5: why call 4's "warm" first step (a second optimizer's, kernels loaded) ranged 87-154 ms
# on Llama. Hypothesis: a garbage collection of the dropped first optimizer (reference cycles)
# inside the timed step. A diagnostic times six warm first steps per model with gc.callbacks
# recording every collection's generation and duration inside the timed step; then the step
# benchmark twice with gc.collect() before each timed first step (commit of this call).
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
L=$OUT/call5_bench.log
nvidia-smi --query-gpu=name,driver_version --format=csv > $L
timeout 300 python3 - > $OUT/call5_gc.txt 2>&1 <<'PY'
import gc, time, torch
from gefen_bench.param_sets import build_param_set, shapes_for
from gefen_core import Gefen
dev = torch.device("cuda")
events, t0 = [], [0.0]
def cb(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        events.append((info["generation"], (time.perf_counter() - t0[0]) * 1e3))
for model in ("gpt2", "llama"):
    named = build_param_set(shapes_for(model), device=dev, dtype=torch.bfloat16)
    opt = Gefen([p for _, p in named], lr=1e-4)
    opt.step(); torch.cuda.synchronize()  # loads every kernel variant this model needs
    for i in range(6):
        del opt
        collect = i % 2 == 1
        if collect:
            gc.collect()
        opt = Gefen([p for _, p in named], lr=1e-4)
        torch.cuda.synchronize()
        events.clear()
        gc.callbacks.append(cb)
        s = time.perf_counter()
        opt.step(); torch.cuda.synchronize()
        ms = (time.perf_counter() - s) * 1e3
        gc.callbacks.remove(cb)
        print(f"{model} warm first step {i}: gc.collect() before: {collect}  {ms:.1f} ms; "
              f"collections inside: {[(g, round(d, 1)) for g, d in events]}", flush=True)
    del opt, named
    gc.collect(); torch.cuda.empty_cache()
PY
echo "gc diag EXIT $?" >> $L
for i in 1 2; do
timeout 200 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-graph,gefen-blockv-graph,adamw-fused --steps 50 --timeout 90 --out /tmp/s5_$i > /tmp/s5_$i.log 2>&1; echo "step $i EXIT $?" >> $L
cp /tmp/s5_$i/step.json $OUT/call5_step_$i.json
done
cat $L
cat $OUT/call5_gc.txt | grep -v Warn
python3 - <<'PY'
import json, os
for i in (1, 2):
    d = json.load(open(f"{os.environ['OUT']}/call5_step_{i}.json"))
    print("run", i, "failed:", d.get("failed"))
    for r in d["rows"]:
        print(r["model"], r["optimizer"], round(r["step_ms_median"], 3), "first", round(r["first_step_ms"], 1), "warm first", round(r["first_step_warm_ms"], 1))
PY
