#!/bin/bash
# Call 2: the first step with batched period scores (multi_period_scores) and the faster
# decision-table build. GPU tests of the new tree; profile_step.py's first step of a third
# optimizer (kernels loaded) alternating the tree before this session (8b131c8, .gpu/base) and
# the new one (.gpu/tree); the step bench of the new tree.
set -x
ROOT=$PWD/.gpu
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/call2_bench.log
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $OUT/call2_bench.log
path() { echo $(ls -d $ROOT/$1/packages/*/src | tr '\n' ':')$ROOT/$1/scripts; }
cd $ROOT/tree
export PYTHONPATH=$(path tree)
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 6 > $OUT/call2_kernels_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call2_kernels_gpu_tests.log) &
(cd packages/gefen-core && timeout 200 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py -q -p gefen_pytest_gates -n 3 > $OUT/call2_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/call2_core_gpu_tests.log)
wait
for i in 1 2; do
  for v in base tree; do
    (cd $ROOT/$v && PYTHONPATH=$(path $v) timeout 110 python3 scripts/profile_step.py --models gpt2,llama --modes factored --steps 5 > $OUT/call2_profile_${v}$i.txt 2>&1; echo "profile $v$i EXIT $?" >> $OUT/call2_bench.log)
  done
done
mkdir -p /tmp/step
timeout 110 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,adamw-fused --steps 50 --timeout 90 --out /tmp/step > /tmp/step.log 2>&1; echo "step EXIT $?" >> $OUT/call2_bench.log
cp /tmp/step/step.json $OUT/call2_step.json
tail -n 3 $OUT/call2_kernels_gpu_tests.log $OUT/call2_core_gpu_tests.log
grep -h "first step of a third\|===" $OUT/call2_profile_*.txt
cat $OUT/call2_bench.log
