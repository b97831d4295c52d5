#!/usr/bin/env bash
# The triton backend's tests at full size on a CUDA machine (the contract suite with
# full-size shapes, plus the gpu-marked tests), then the benchmark's correctness sweep.
#   bash bench/gpu_tests.sh            (from the repository root; writes under $OUT or .)
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-.}"
ANYATTN_SUITE_BACKENDS=triton python3 -m pytest tests/backends tests/triton -q 2>&1 | tee "$out/gpu_tests.log"
python3 bench/gpu_bench.py --check --out "$out" 2>&1 | tee "$out/gpu_check.log"
