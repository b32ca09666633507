#!/bin/bash
# Call B: GPU tests (anchored gradient offsets, replay in the freed-gradient loop), the loop's
# replay rate with a profile, the step bench with graph replay off and on, the first-step profile.
set -x
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/callB_machine.txt
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $OUT/callB_machine.txt
nproc >> $OUT/callB_machine.txt
(cd packages/gefen-kernels && timeout 220 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 4 > $OUT/callB_kernels_tests.log 2>&1; echo EXIT $? >> $OUT/callB_kernels_tests.log; timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -n 4 >> $OUT/callB_kernels_tests.log 2>&1; echo EXIT $? >> $OUT/callB_kernels_tests.log) &
KPID=$!
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py tests/test_step_graphs_switch.py -q -p gefen_pytest_gates -n 4 > $OUT/callB_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/callB_core_gpu_tests.log)
wait $KPID
timeout 150 python3 scripts/graph_replay_rate.py --steps 40 --profile --out $OUT/callB_graph_replay.json > $OUT/callB_graph_replay.log 2>&1; echo EXIT $? >> $OUT/callB_graph_replay.log
mkdir -p /tmp/on /tmp/off
GEFEN_CUDA_GRAPHS=1 timeout 170 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,gefen-blockv,adamw-fused,adamw-foreach --steps 50 --timeout 100 --out /tmp/on > $OUT/callB_step.log 2>&1; echo EXIT $? >> $OUT/callB_step.log
GEFEN_CUDA_GRAPHS=0 timeout 120 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,adamw-fused --steps 50 --timeout 100 --out /tmp/off >> $OUT/callB_step.log 2>&1; echo EXIT $? >> $OUT/callB_step.log
cp /tmp/on/step.json $OUT/callB_step_graphs_on.json; cp /tmp/off/step.json $OUT/callB_step_graphs_off.json
for f in $OUT/*.log; do echo "== $f"; tail -n 3 $f; done
