#!/usr/bin/env bash
# On-CPU time per memory check: ours, governor's keyed limiter (DashMap)
# and pingora-limits' `Rate`, at 10, 10^4 and 10^6 live keys
# `rl:ip:<IPv4>` (the work of `memory_check/<n>` in benches/hot_path.rs),
# and the two-thread modes, each thread on its own keys: `ours_2_threads`
# (one store), `ours_2_stores` (a store each: nothing shared, the host's
# own ceiling for two threads) and `governor_2_threads` (one limiter).
#
#   benches/check_time.sh                                   # ~4 min
#   ROUNDS=5 IMPLS="ours governor" SIZES="10 1000000" benches/check_time.sh
#   BENCH_DIR=target/release benches/check_time.sh          # a prebuilt check_ir
#
# Each (implementation, size) runs tools/src/bin/check_ir.rs under `perf
# stat -e task-clock` with C1 and C2 checks (default 2·10^6 and 10^7) and
# prints (T(C2) − T(C1)) / (C2 − C1) per round, then the median: the CPU
# time of one check, setup and exit excluded (for a two-thread mode, divided
# by the checks of both threads). task-clock counts only the time this
# process ran, so other processes on a shared host inflate it far less than
# wall-clock times (they still share its caches); implementations are
# interleaved round by round, so compare them within a round. No hardware
# counters are needed (there are none in most VMs); instructions per check
# are benches/check_ir.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
IMPLS=${IMPLS:-"ours governor pingora_rate"}
SIZES=${SIZES:-"10 10000 1000000"}
ROUNDS=${ROUNDS:-3}
C1=${C1:-2000000}
C2=${C2:-10000000}
command -v perf >/dev/null 2>&1 || { echo "perf not found on PATH" >&2; exit 1; }
if [[ -z "${BENCH_DIR:-}" ]]; then
  cargo build --quiet --release -p tiered-ratelimit-tools --bin check_ir
  BENCH_DIR=target/release
fi
clock_ms() { # impl keys checks -> task-clock ms
  perf stat -x, -e task-clock "$BENCH_DIR/check_ir" "$1" "$2" "$3" 2>&1 >/dev/null \
    | awk -F, '/task-clock/ { print $1 }'
}
echo "| implementation | keys | ns per check, rounds | median |"
echo "|---|---:|---|---:|"
for n in $SIZES; do
  declare -A runs=()
  for _ in $(seq "$ROUNDS"); do
    for impl in $IMPLS; do
      a=$(clock_ms "$impl" "$n" "$C1")
      b=$(clock_ms "$impl" "$n" "$C2")
      per=1
      [[ $impl == *_2_* ]] && per=2
      runs[$impl]+="$(python3 -c "print('%.1f' % (($b - $a) * 1e6 / ($C2 - $C1) / $per))") "
    done
  done
  for impl in $IMPLS; do
    python3 - "$impl" "$n" ${runs[$impl]} <<'PY'
import statistics, sys
impl, n, xs = sys.argv[1], sys.argv[2], [float(x) for x in sys.argv[3:]]
print("| %s | %s | %s | **%.1f** |" % (impl, n, ", ".join("%.1f" % x for x in xs), statistics.median(xs)))
PY
  done
  unset runs
done
