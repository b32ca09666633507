#!/bin/bash
# Call E (after the review): GPU tests incl. a moved direct gradient, the staged-launch test on
# CUDA with an unaligned lone plan, and the real loop with and without a sync per step.
set -x
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/callE_machine.txt
(cd packages/gefen-kernels && timeout 200 python3 -m pytest tests/ops/test_step_groups.py -q -p gefen_pytest_gates -n 4 > $OUT/callE_tests.log 2>&1; echo "kernels EXIT $?" >> $OUT/callE_tests.log) &
KPID=$!
(cd packages/gefen-core && timeout 240 python3 -m pytest tests/test_gefen_gpu.py tests/test_step_graphs_gpu.py tests/test_steady_step.py tests/test_step_graphs_switch.py -q -p gefen_pytest_gates -n 4 > $OUT/callE_core_tests.log 2>&1; echo "core EXIT $?" >> $OUT/callE_core_tests.log)
wait $KPID
timeout 150 python3 scripts/graph_replay_rate.py --steps 40 --loop-steps 30 --out $OUT/callE_graph_replay_b8.json > /dev/null 2>&1; echo "b8 EXIT $?" >> $OUT/callE_tests.log
timeout 150 python3 scripts/graph_replay_rate.py --steps 40 --loop-steps 100 --batch 2 --seq 128 --out $OUT/callE_graph_replay_b2.json > /dev/null 2>&1; echo "b2 EXIT $?" >> $OUT/callE_tests.log
tail -n 4 $OUT/callE_core_tests.log $OUT/callE_tests.log
