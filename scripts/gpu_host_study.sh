#!/usr/bin/env bash
# Where a capture step's host time goes on the GPU machine as it comes: on a slow host (a
# torch op 10 us, as the H200 of the matrix at 0458b79) ResNet-50's capture step was
# host-bound, its forward, backward and step taking 35.4 ms of host time in a 35.1 ms step,
# and bf16 + channels_last ResNet-18's was too; which host work to cut is read off this.
#
#   bash scripts/gpu_host_study.sh                      # ResNet-50 and bf16 + channels_last ResNet-18
#   HOST_WORKLOADS=gpt bash scripts/gpu_host_study.sh
#
# Per workload ($HOST_WORKLOADS, default "resnet50 resnet18-bf16cl"): scripts/profile_capture.py
# (the host operations per phase that a capture step changes most, and cProfile of its forward and
# step) and scripts/capture_gap.py on the current and on the side stream (the gap, and the host's
# forward, backward and step above a normal step's per captured layer); then
# scripts/host_costs.py (each extension call alone beside a torch op).  Logs under $OUT, one per
# script and workload (at most 7 files: that machine returns 8); a short table last.
source "$(dirname "$0")/gpu_env.sh"
python3 -m lightning_cafin.kernels.loader --build > /tmp/build.log 2>&1 || { echo "build failed:"; tail -20 /tmp/build.log; exit 1; }
for w in ${HOST_WORKLOADS:-resnet50 resnet18-bf16cl}; do
  python3 scripts/profile_capture.py --workload "$w" --out /tmp/profile > /dev/null 2>&1 \
    && cp "/tmp/profile/profile-capture-$w.txt" "$OUT/" || echo "profile_capture.py $w failed"
  { python3 scripts/capture_gap.py --workload "$w" && python3 scripts/capture_gap.py --workload "$w" --side; } \
    > "$OUT/capture-gap-$w.txt" 2>&1 || echo "capture_gap.py $w failed"
done
python3 scripts/host_costs.py > "$OUT/host-costs.txt" 2>&1 || echo "host_costs.py failed"
grep -h -E "^workload|capture - normal|above normal|per captured layer" "$OUT"/capture-gap-*.txt "$OUT"/profile-capture-*.txt | head -30
