#!/usr/bin/env bash
# The side stream's study on the GPU machine, in one call: build the extension, run the side
# stream's bit-identical GPU tests, scripts/capture_variants.py per workload (every capture
# variant in one process: which side stream had the gain there), then scripts/step_gaps.py on
# ResNet-18 in SIDE_PROCESSES fresh processes (the timelines of processes with and without the
# side stream's gain).
# Logs under $OUT (4 files), their lines last.
# Env: SIDE_WORKLOADS (default "resnet50 resnet18"), SIDE_STEPS (capture_variants' rounds, default
# 16), SIDE_PROCESSES (default 3), SIDE_CONNECTIONS (CUDA_DEVICE_MAX_CONNECTIONS values, each its
# own capture_variants processes, e.g. "8 32": whether the side stream's gain, which has come and
# gone from process to process and followed the stream rather than its priority, follows the
# driver's hardware queues, 8 unless that variable is set; default: the machine's setting only).
source "$(dirname "$0")/gpu_env.sh"
python3 -m lightning_cafin.kernels.loader --build > "$OUT/build.log" 2>&1 \
  || { echo "build failed:"; tail -20 "$OUT/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider -m cuda tests/capture/test_hooks.py -k side_stream > "$OUT/side_tests.log" 2>&1
echo "side-stream tests rc=$?: $(tail -1 "$OUT/side_tests.log")"
for c in ${SIDE_CONNECTIONS:-default}; do
  if [ "$c" = default ]; then run=(python3); prefix=""; else run=(env CUDA_DEVICE_MAX_CONNECTIONS="$c" python3); prefix="connections $c: "; fi
  for w in ${SIDE_WORKLOADS:-resnet50 resnet18}; do
    "${run[@]}" scripts/capture_variants.py --workload "$w" --steps "${SIDE_STEPS:-16}" > /tmp/variants-one.log 2>&1 \
      || echo "capture_variants.py --workload $w failed (see variants.log)"
    sed "/ rounds: normal /s/^/${prefix}/" /tmp/variants-one.log >> "$OUT/variants.log"
  done
done
for i in $(seq "${SIDE_PROCESSES:-3}"); do
  echo "=== process $i" >> "$OUT/gaps.log"
  python3 scripts/step_gaps.py --workload resnet18 >> "$OUT/gaps.log" 2>&1 \
    || echo "step_gaps.py process $i failed (see gaps.log)"
done
grep " rounds: normal " "$OUT/variants.log"
if [ -f "$OUT/gaps.log" ]; then grep -E "^(=== |  )" "$OUT/gaps.log"; fi  # (none with SIDE_PROCESSES=0)
