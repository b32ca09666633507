#!/bin/bash
# Call A: GPU tests of the changed code, then the replay rate in a real loop.
set -x
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/callA_machine.txt
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $OUT/callA_machine.txt
nproc >> $OUT/callA_machine.txt
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests -m gpu -q -p gefen_pytest_gates -n 6 -x > $OUT/callA_kernels_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/callA_kernels_gpu_tests.log) &
KPID=$!
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -n 2 > $OUT/callA_step_groups_cuda.log 2>&1; echo EXIT $? >> $OUT/callA_step_groups_cuda.log)
wait $KPID
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py tests/test_step_graphs_switch.py -q -p gefen_pytest_gates -n 4 > $OUT/callA_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/callA_core_gpu_tests.log)
timeout 150 python3 scripts/graph_replay_rate.py --steps 40 --out $OUT/callA_graph_replay.json > $OUT/callA_graph_replay.log 2>&1; echo EXIT $? >> $OUT/callA_graph_replay.log
tail -3 $OUT/*.log
