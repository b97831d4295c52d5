#!/bin/bash
# Session 8, issue 17 round 2 (WebGPU helper): the dQ pass's dS prefetch (DSQ_PF) and the
# chunked dS scratch on the H200 (bench/webgpu_s8_check.py: bits, then S=4096 / 8192 times).
# Run from the repository root with $OUT set and wgpu / the Vulkan ICD set up (PYTHONPATH
# with wgpu, VK_DRIVER_FILES, ANYATTN_WGPU_ADAPTER=vulkan); at most 60 s.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
timeout 55 python3 bench/webgpu_s8_check.py > "$OUT/webgpu-s8-check.log" 2>&1
echo "webgpu_s8_check rc $?" >> "$OUT/webgpu-s8-check.log"
tail -20 "$OUT/webgpu-s8-check.log"
