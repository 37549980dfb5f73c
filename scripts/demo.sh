#!/usr/bin/env bash
# `make demo`: the main job on this machine. Until the daemon lands this runs the kernel
# benchmark on the CPU backend at the small preset (n = 16384 tokens), which exercises
# every op of the shadow profile end to end and prints each figure beside the H200 floor.
set -euo pipefail
BUILD=${1:-build}
"$BUILD/bench/kvshade_kernel_bench" --backend cpu --preset small --reps 3
