#!/bin/bash
# Call 1: the tile route's head + tail pieces (tile_shape's TAIL). GPU tests of the new code;
# kernel_ablation.py timing TAIL against one [BPP, P2] tile on the same kernel; the step bench
# alternating the old kernels (HEAD~1's packages/gefen-kernels/src, carried in .gpu/old) and
# the new.
set -x
cd .gpu/tree
NEW=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
OLD=$PWD/../old/packages/gefen-kernels/src:$NEW
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call1_bench.log
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $OUT/call1_bench.log
export PYTHONPATH=$NEW
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 6 > $OUT/call1_kernels_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call1_kernels_gpu_tests.log) &
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py -q -p gefen_pytest_gates -n 3 > $OUT/call1_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call1_core_gpu_tests.log)
wait
timeout 130 python3 scripts/kernel_ablation.py --variants base,one_tile,base_again --block-periods 1336,1152,1392,1536,96,2048 --reps 30 > $OUT/call1_ablation.txt 2>&1; echo "ablation EXIT $?" >> $OUT/call1_bench.log
for v in old new; do
  mkdir -p /tmp/$v
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 100 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused --steps 50 --timeout 90 --out /tmp/$v > /tmp/$v.log 2>&1; echo "$v EXIT $?" >> $OUT/call1_bench.log
  PYTHONPATH=$P python3 -c "import gefen_kernels.ops._step_kernels as k; print('$v', k.__file__)" >> $OUT/call1_bench.log
  cp /tmp/$v/step.json $OUT/call1_step_$v.json
done
tail -n 3 $OUT/call1_kernels_gpu_tests.log $OUT/call1_core_gpu_tests.log
cat $OUT/call1_bench.log
grep -E "^(factored|block) " $OUT/call1_ablation.txt
python3 - <<'PY'
import json, os
for v in ("old", "new"):
    d = json.load(open(f"{os.environ['OUT']}/call1_step_{v}.json"))
    for r in d["rows"]:
        print(v, r.get("model"), r.get("optimizer"), round(r.get("step_ms_median") or -1, 3), round(r.get("first_step_ms") or -1, 1))
PY
