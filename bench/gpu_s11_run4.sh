#!/bin/bash
# Session 11 (issue 15), run 4: at most RUN_S (default 260) seconds, everything under $OUT:
#   1. the GPU tests of tests/triton/test_hopper_bwd_dq.py (every variant; 'r' on the
#      transposed consumers bitwise equal to 'nht') -> $OUT/tests;
#   2. backward timings, 3 rotated rounds: D=64 S=4k ('nht' 128-row, the route without a
#      mask; 'nhtr' 128-row; 'nhr' s3, the band's route) -> $OUT/bench64; D=128 ('nhr', the
#      route; 'nhtr') -> $OUT/bench;
#   3. the D=128 forward in device time: the routed per-tile kernel vs the scheduled
#      persistent one, S=2k / 4k / 8k causal or not (bench/gpu_fwd_graph_ab.py) -> $OUT/fwd.
DEFAULT_RUN_S=260; . bench/run_budget.sh
T128=wdkdvq128x128s2nht
T128R=wdkdvq128x128s2nhtr
TR=wdkdvq128x64s2nhtr
mkdir -p $OUT/tests $OUT/bench $OUT/bench64 $OUT/fwd
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 90) python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --timeout 80 \
  tests/triton/test_hopper_bwd_dq.py > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR|Error" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
el "D=64 timings"
timeout $(cap 45) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
  --dims 64 --configs default,$T128,$T128R --diag '' > $OUT/bench64/bench.log 2>&1
echo "bench64 rc $?"
grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-600
el "D=128 timings"
timeout $(cap 55) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default,$TR --diag '' > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-600
el "forward"
timeout $(left) python3 bench/gpu_fwd_graph_ab.py --out $OUT/fwd --configs ws128x128s2opfPg \
  > $OUT/fwd/fwd.log 2>&1
echo "fwd rc $?"; grep -E "^fwd|Error" $OUT/fwd/fwd.log | cut -c1-400
el "done"
