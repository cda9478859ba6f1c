#!/usr/bin/env bash
# A/B of two source trees on one GPU in one run: gpu_bench's tg128 and pp2048 and spec_bench's
# n-gram speedup on the target's own looping output, each tree in turn, ROUNDS times, so drift
# falls on both alike. A tree is a directory holding tokenmill/ and benchmarks/ (e.g. an older
# commit's `git archive`). Logs go to $OUT (or /tmp).
#   bash benchmarks/ab_bench.sh BEFORE_DIR AFTER_DIR [ROUNDS]
set -uo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); rounds=${3:-2}
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
for round in $(seq "$rounds"); do
  for tree in "$before" "$after"; do
    name=$([ "$tree" = "$before" ] && echo before || echo after)
    echo "=== round $round: $name ($tree)"
    (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/gpu_bench.py --only tg,pp \
        --json "$out/${name}_gpu_$round.json" 2>&1 | grep -v "^capturing" | tail -n 8)
    (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/spec_bench.py --parts ngram-own \
        --ngram-gammas 3 --ngram-seeds 11 2>&1 | grep -E "ngram|no speculation|ratio" | tail -n 6)
  done
done
