#!/bin/bash
# Every GPU check and benchmark of the open work, prioritised, in two parts that each fit
# one 10-minute device call.  Results (a log and a tarball of the JSON/PNG files) go under
# $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh 1     # gpu tests, Hopper modifiers / D=256 / capture grads /
#                                   # value dims / decoding benches (~550 s on an H100/H200)
#   bash bench/gpu_session.sh 2     # standings vs cuDNN / flash, gallery vs Flex, varlen
#   bash bench/gpu_session.sh 3     # score / mask functions only: the gallery vs Flex
#                                   # (bf16 at S 4096 and 8192, fp32 at 4096), their CUDA
#                                   # tests, other fwd / dK/dV tiles, capture-gradient cost
#                                   # (~550 s; JSON under $OUT)
#   bash bench/gpu_session.sh 3q    # part 3 cut to ~280 s
#
# Wheels that the machine lacks (pytest, pytest-xdist, hypothesis, threadpoolctl, ...) are
# installed from .whl/ when that folder exists.
set -u
PART=${1:-1}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PWD/src:/tmp/site
else
    export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
R=/tmp/gpu-res$PART
mkdir -p $R/hm
L=$OUT/log$PART.txt
step() { echo "=== $(date +%T) $*" >>"$L"; }
run() { local t=$1; shift; timeout "$t" "$@" >>"$L" 2>&1; echo "rc=$?" >>"$L"; }

nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv >>"$L" 2>&1
if [ "$PART" = 1 ]; then
    step "gpu tests";        run 130 python3 -m pytest -q -n 15 -m gpu tests -p no:cacheprovider -rf \
                                 --ignore=tests/triton/test_hopper_mods.py
    step "hopper modifiers"; run 70 python3 -m pytest -q -n 15 -m gpu tests/triton/test_hopper_mods.py \
                                 -p no:cacheprovider -rf
    step "functions on CUDA"; run 60 python3 -m pytest -q -n 15 -p no:cacheprovider -rf \
                                 tests/triton/test_triton_capture_grads.py tests/triton/test_triton_pair_reads.py \
                                 tests/triton/test_triton_score_mods.py tests/triton/test_triton_value_dim.py
    step "hopper modifiers bench"; run 100 python3 bench/gpu_hopper_mods_bench.py --out $R/hm
    step "hopper D=256 forward";   run 60 python3 bench/lab/hopper_d256_fwd.py --json $R/d256.json
    step "capture gradients";      run 35 python3 bench/lab/capture_grads_time.py --json $R/capture_grads.json
    step "value dims";             run 45 python3 bench/gpu_value_dim_bench.py --seqs 4096 --out $R
    step "decoding";               run 45 python3 bench/gpu_flash_attn_bench.py --decode \
                                       --caches 4096 32768 131072 --batches 1 8 32 --out $R/decode.json
elif [ "$PART" = 3q ]; then
    R=$OUT                          # part 3 cut to ~280 s: the gallery at S=4096, the tests
    step "gallery vs Flex bf16"; run 200 python3 bench/gpu_gallery_vs_flex.py --seqs 4096 \
                                 --reps 5 --out $R
    step "functions on CUDA"; run 60 python3 -m pytest -q -n 15 -p no:cacheprovider -rf \
                                 tests/triton/test_triton_capture_grads.py tests/triton/test_triton_pair_reads.py \
                                 tests/triton/test_triton_score_mods.py
elif [ "$PART" = 3 ]; then
    R=$OUT                          # results straight under $OUT: a run cut short keeps them
    step "functions on CUDA"; run 60 python3 -m pytest -q -n 15 -p no:cacheprovider -rf \
                                 tests/triton/test_triton_capture_grads.py tests/triton/test_triton_pair_reads.py \
                                 tests/triton/test_triton_score_mods.py tests/triton/test_triton_value_dim.py
    step "gallery vs Flex bf16"; run 230 python3 bench/gpu_gallery_vs_flex.py --seqs 4096,8192 \
                                 --reps 5 --out $R
    step "other tiles";   run 100 python3 bench/gpu_gallery_vs_flex.py --seqs 4096 --reps 5 \
                                 --only relative_position_bias,t5_buckets,dilated,neighbourhood_2d,tanh_gate \
                                 --alt fwd=128,64,8,3 --alt dkdv=32,128,8,3 --no-flex --out $R/tiles
    step "capture gradients";      run 30 python3 bench/lab/capture_grads_time.py --json $R/capture_grads.json
    step "gallery vs Flex fp32"; run 110 python3 bench/gpu_gallery_vs_flex.py --seqs 4096 \
                                 --dtype float32 --reps 3 --out $R
else
    step "standings";        run 240 python3 bench/gpu_standings.py --no-flex --out $R
    step "gallery vs Flex";  run 200 python3 bench/gpu_gallery_vs_flex.py --seqs 4096 --reps 5 --out $R
    step "varlen";           run 90 python3 bench/gpu_flash_attn_bench.py --out $R/varlen.json
fi
step done
[ "${PART:0:1}" = 3 ] || tar czf "$OUT/res$PART.tgz" -C /tmp "gpu-res$PART"
