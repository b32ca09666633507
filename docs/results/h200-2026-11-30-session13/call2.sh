#!/bin/bash
# Call 2: after restoring the one-tile path's operation order (same PTX as before for TAIL=0).
# GPU tests of the new code; the ablation again; GPT-2's periods; per-kernel device time of
# GPT-2's steady step (profile_step.py) old / new; the GPT-2 step bench old / new / old / new
# (old = the kernels before this session, HEAD~3, in .gpu/old).
set -x
cd .gpu/tree
NEW=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
OLD=$PWD/../old/packages/gefen-kernels/src:$NEW
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call2_bench.log
export PYTHONPATH=$NEW
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 6 > $OUT/call2_kernels_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call2_kernels_gpu_tests.log) &
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py -q -p gefen_pytest_gates -n 3 > /tmp/core_gpu_tests.log 2>&1; echo EXIT $? >> /tmp/core_gpu_tests.log)
wait
(echo '--- gefen-core GPU tests (tail)'; tail -n 30 /tmp/core_gpu_tests.log) >> $OUT/call2_bench.log
timeout 100 python3 scripts/kernel_ablation.py --variants base,one_tile,base_again --block-periods 1336,1152,1392,96,2048 --reps 30 --no-periods > $OUT/call2_ablation.txt 2>&1; echo "ablation EXIT $?" >> $OUT/call2_bench.log
python3 - >> $OUT/call2_ablation.txt 2>&1 <<'PY'
from collections import Counter
import torch
from gefen_bench.param_sets import build_param_set, shapes_for
from gefen_core import Gefen
from gefen_kernels.ops._step_kernels import tile_shape
named = build_param_set(shapes_for("gpt2", "full"), device=torch.device("cuda"), dtype=torch.bfloat16)
opt = Gefen(named, lr=1e-4, weight_decay=0.0)
opt.step()
seen = Counter()
for p in [p for g in opt.param_groups for p in g["params"]]:
    st = opt.state[p]
    if "exp_avg_codes" in st:
        b, per = st["exp_avg_codes"].shape
        seen[(tuple(p.shape), int(per), tile_shape(int(per))[2], "exp_avg_sq_row" in st)] += 1
print("\nGPT-2-shaped set after one Gefen step (shape, period, TAIL, factored): count")
for k, c in sorted(seen.items(), key=lambda kv: -kv[1] * torch.Size(kv[0][0]).numel()):
    print(" ", k, c)
PY
for v in old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 90 python3 scripts/profile_step.py --models gpt2 --modes factored,block --steps 5 > /tmp/profile_$v.txt 2>&1; echo "profile $v EXIT $?" >> $OUT/call2_bench.log
  grep -E "===|_group_tile_kernel|_group_stats_kernel|_step_tile_kernel|Self CUDA time total|steady:" /tmp/profile_$v.txt | sed "s/^/$v /" >> $OUT/call2_profile.txt
done
for i in 1 2; do
  for v in old new; do
    mkdir -p /tmp/$v$i
    if [ $v = old ]; then P=$OLD; else P=$NEW; fi
    PYTHONPATH=$P timeout 60 python3 -m gefen_bench.cli step --models gpt2 --optimizers gefen,gefen-blockv,adamw-fused --steps 50 --timeout 50 --out /tmp/$v$i > /tmp/$v$i.log 2>&1; echo "$v$i EXIT $?" >> $OUT/call2_bench.log
    cp /tmp/$v$i/step.json $OUT/call2_step_$v$i.json
  done
done
tail -n 3 $OUT/call2_kernels_gpu_tests.log
cat $OUT/call2_bench.log
grep -E "^(factored|block) |^  \(" $OUT/call2_ablation.txt
cat $OUT/call2_profile.txt
python3 - <<'PY'
import json, os
for i in (1, 2):
    for v in ("old", "new"):
        d = json.load(open(f"{os.environ['OUT']}/call2_step_{v}{i}.json"))
        for r in d["rows"]:
            print(v, i, r["model"], r["optimizer"], round(r["step_ms_median"], 3), "host", round(r["host_issue_ms_median"], 3))
PY
