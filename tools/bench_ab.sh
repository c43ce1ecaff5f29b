#!/usr/bin/env bash
# A/B of tools/bench.py between an older tree and this one, alternating, in one run (one
# device call): the way a change that should not move a figure is measured.
#
#   git archive BASE_COMMIT cvllm tools | (mkdir -p .ab/base && tar -x -C .ab/base)
#   tools/bench_ab.sh .ab/base OUT_DIR 2 bf16 q4k        # 2 rounds of each config
#
# Each config runs `tools/bench.py --quick --no-hf-peer --no-plot --prefill-batches 4
# --decode-batches 1,64` (plus `--engine-opt isq=q4k` for q4k) in the base tree, then in
# this one; BENCH_ARGS replaces those flags (e.g. "--tiny --cpu" to try it on a CPU). The
# JSONs go to OUT_DIR as ab-CONFIG-{base,new}-ROUND.json; one line a run is printed with
# its decode rows (batch, tokens/s, median ms a step).
set -u
base=$(cd "$1" && pwd); out=$2; rounds=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
args=${BENCH_ARGS:---quick --no-hf-peer --no-plot --prefill-batches 4 --decode-batches 1,64}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for config in "$@"; do
    for tree in base new; do
      dir=$here; [ "$tree" = base ] && dir=$base
      opt=""; [ "$config" = q4k ] && opt="--engine-opt isq=q4k"
      json=$out/ab-$config-$tree-$round.json
      # shellcheck disable=SC2086  # the flags are words
      (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} python3 tools/bench.py $args $opt \
        --out "$json" > "$out/ab-$config-$tree-$round.log" 2>&1)
      python3 - "$json" "$config $tree $round" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    rows = [(r["batch"], round(r["tokens_per_s"], 1), round(r["ms_per_step_median"], 4))
            for r in d.get("decode", [])]
    print(sys.argv[2], rows, "errors", d.get("errors"))
except (OSError, ValueError, KeyError) as exc:
    print(sys.argv[2], "no report:", exc)
PY
    done
  done
done
