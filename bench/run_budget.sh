# Sourced by the one-shot GPU run scripts (bench/gpu_s*.sh): the environment and a time
# budget.  Set RUN_S (seconds, default DEFAULT_RUN_S or 300) before sourcing.
#   el NAME   prints "=== NAME at <seconds since the start> s"
#   left      the seconds left of RUN_S
#   cap N     min(N, left): a phase's timeout
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "=== $1 at $(( $(date +%s) - T0 )) s"; }
left() { echo $(( ${RUN_S:-${DEFAULT_RUN_S:-300}} - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? l : $1 )); }
