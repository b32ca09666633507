#!/bin/bash
# Call C: the first step with kernels loaded (profile_step's third optimizer), batched period
# search (this tree) against per-tensor search (HEAD's gefen-core, .gpu/old), alternating.
set -x
NEW=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
OLD=$PWD/.gpu/old/packages/gefen-core/src:$NEW
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/callC_machine.txt
PYTHONPATH=$NEW timeout 150 python3 scripts/profile_step.py --models gpt2,llama --modes factored --steps 5 > $OUT/callC_profile_new1.txt 2>&1
PYTHONPATH=$OLD timeout 150 python3 scripts/profile_step.py --models gpt2,llama --modes factored --steps 5 > $OUT/callC_profile_old.txt 2>&1
PYTHONPATH=$NEW timeout 150 python3 scripts/profile_step.py --models gpt2,llama --modes factored --steps 5 > $OUT/callC_profile_new2.txt 2>&1
PYTHONPATH=$OLD python3 -c "import gefen_core.optimizer as o; print(o.__file__, hasattr(o.Gefen, '_select_periods'))" >> $OUT/callC_machine.txt
PYTHONPATH=$NEW python3 -c "import gefen_core.optimizer as o; print(o.__file__, hasattr(o.Gefen, '_select_periods'))" >> $OUT/callC_machine.txt
grep -h "third optimizer\|===" $OUT/callC_profile_*.txt
