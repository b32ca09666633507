#!/bin/bash
# Call D: the default (steady-step replay on) against GEFEN_CUDA_GRAPHS=0: GPU tests with the
# default, the real loop, and the step bench alternating off/on/off/on in one call.
set -x
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/callD_machine.txt
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)" >> $OUT/callD_machine.txt
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py tests/test_step_graphs_switch.py -q -p gefen_pytest_gates -n 4 > $OUT/callD_core_gpu_tests.log 2>&1; echo EXIT $? >> $OUT/callD_core_gpu_tests.log)
timeout 150 python3 scripts/graph_replay_rate.py --steps 40 --out $OUT/callD_graph_replay.json > /dev/null 2>&1; echo EXIT $? >> $OUT/callD_core_gpu_tests.log
for i in 1 2; do
  mkdir -p /tmp/off$i /tmp/on$i
  GEFEN_CUDA_GRAPHS=0 timeout 100 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,adamw-fused --steps 50 --timeout 80 --out /tmp/off$i > /dev/null 2>&1; echo "off$i EXIT $?" >> $OUT/callD_core_gpu_tests.log
  timeout 100 python3 -m gefen_bench.cli step --models gpt2,llama --optimizers gefen,adamw-fused --steps 50 --timeout 80 --out /tmp/on$i > /dev/null 2>&1; echo "on$i EXIT $?" >> $OUT/callD_core_gpu_tests.log
  cp /tmp/off$i/step.json $OUT/callD_step_off$i.json; cp /tmp/on$i/step.json $OUT/callD_step_on$i.json
done
tail -n 8 $OUT/callD_core_gpu_tests.log
