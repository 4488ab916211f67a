#!/usr/bin/env bash
# A same-machine A/B of a change on the GPU machine: the checkout as it is (A) against the
# checkout with a patch applied (B), alternated A B A B ... so that the host's drift over the
# call falls on both sides alike.  Capture-step figures of different machines differ by more
# than most changes move them; one machine, both sides, is the comparison that decides.
#
#   git diff main my-branch -- csrc lightning_cafin > ab.patch   # untracked, so it is carried
#   bash scripts/gpu_ab.sh ab.patch
#
# Each round builds the extension for the side's sources (built once per side: the build
# cache keys on the sources) and runs the bench's matrix for $AB_ONLY (default
# resnet18-bf16cl; a comma list) with $AB_BENCH_ARGS, or $AB_CMD instead where set (a shell
# command, e.g. a kernel-level measure such as scripts/statistics_bandwidth.py, whose device
# times move less between runs than a train step's); $AB_ROUNDS rounds (default 2).  Logs
# under $OUT (one per side, appended), the rows named by $AB_ROWS (default: the step-synchronous
# capture step and the host's price of a launch) last, per round and side.  The checkout is
# left as it was found (the patch taken out again), also after a failure.  With AB_CMD running
# scripts/step_kernels.py, scripts/kernels_ab.py $OUT/bench-A.log $OUT/bench-B.log compares
# the two sides launch by launch (B - A).
patch_file="${1:-}"
if [ -z "$patch_file" ] || [ ! -f "$patch_file" ]; then
  echo "usage: bash scripts/gpu_ab.sh PATCH (a git diff to apply for side B; got '${patch_file}', no such file)" >&2
  exit 2
fi
patch_file="$(cd "$(dirname "$patch_file")" && pwd)/$(basename "$patch_file")"  # (before gpu_env.sh's cd)
source "$(dirname "$0")/gpu_env.sh"
rounds="${AB_ROUNDS:-2}"
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_ab.sh: AB_ROUNDS must be a positive integer, got '$rounds'" >&2
  exit 2
fi
rows="${AB_ROWS:-capture step above normal|capture step vs normal|^host:}"
git apply --check "$patch_file" || { echo "gpu_ab.sh: $patch_file does not apply to this checkout" >&2; exit 2; }
applied=0
take_out() { if [ "$applied" = 1 ]; then git apply -R "$patch_file" && applied=0; fi; }
trap take_out EXIT

failed() {  # failed(what, log): say so with the log's end, and stop (the EXIT trap takes the patch out)
  echo "gpu_ab.sh: $1 failed (the end of $2):" >&2
  tail -20 "$2" >&2
  exit 1
}

side() {  # side(A|B, round): the tree as that side, its build, one bench run
  local name="$1" round="$2"
  if [ "$name" = B ] && [ "$applied" = 0 ]; then git apply "$patch_file" && applied=1; fi
  if [ "$name" = A ]; then take_out; fi
  python3 -m lightning_cafin.kernels.loader --build >> "$OUT/build-$name.log" 2>&1 \
    || failed "side $name's build" "$OUT/build-$name.log"
  echo "== round $round, side $name" >> "$OUT/bench-$name.log"
  if [ -n "${AB_CMD:-}" ]; then
    bash -c "$AB_CMD" > "/tmp/ab-$name-$round.log" 2>&1 || failed "side $name's AB_CMD" "/tmp/ab-$name-$round.log"
  else
    # shellcheck disable=SC2086  # (AB_BENCH_ARGS: words on purpose)
    python3 -m lightning_cafin.bench --matrix-only --only "${AB_ONLY:-resnet18-bf16cl}" --out "/tmp/ab-$name-$round" \
        ${AB_BENCH_ARGS:-} > "/tmp/ab-$name-$round.log" 2>&1 || failed "side $name's bench" "/tmp/ab-$name-$round.log"
  fi
  cat "/tmp/ab-$name-$round.log" >> "$OUT/bench-$name.log"
  grep -E "$rows" "/tmp/ab-$name-$round.log" | sed "s/^/round $round $name  /" >> "$OUT/ab.txt"
}

: > "$OUT/ab.txt"
for round in $(seq 1 "$rounds"); do
  side A "$round"
  side B "$round"
done
take_out
sort -s -k3,3 "$OUT/ab.txt"
