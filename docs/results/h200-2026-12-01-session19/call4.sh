#!/bin/bash
# Session 19, call 4: scripts/stream_mutations.py after review, which checks each test's
# outcome (JUnit XML) instead of pytest's exit status, with seven planted faults (the start
# wait also removed for the side and the chain stream alone). .gpu/tree/COMMIT holds the
# archived commit's short hash, written beside the archive.
set -x
cd .gpu/tree
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')$PWD/scripts
export PYTHONUNBUFFERED=1
unset GEFEN_CUDA_GRAPHS
git_commit=$(cat COMMIT 2>/dev/null)
echo "tree: $git_commit" > $OUT/call4_summary.log
timeout 500 python3 scripts/stream_mutations.py --out $OUT/call4_mutations.json >> $OUT/call4_summary.log 2>&1; echo "mutations EXIT $?" >> $OUT/call4_summary.log
cat $OUT/call4_summary.log
