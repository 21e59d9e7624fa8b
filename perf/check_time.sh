#!/usr/bin/env bash
# On-CPU time per memory check: ours, governor's keyed limiter (DashMap)
# and pingora-limits' `Rate`, at 10, 10^4 and 10^6 live keys
# `rl:ip:<IPv4>` (the work of `memory_check/<n>` in benches/hot_path.rs),
# the two-thread modes, each thread on its own keys: `ours_2_threads`
# (one store), `ours_2_stores` (a store each: nothing shared, the host's
# own ceiling for two threads) and `governor_2_threads` (one limiter)
# (perf/src/bin/check_ir.rs).
#
#   perf/check_time.sh                                   # ~3 min
#   ROUNDS=5 IMPLS="ours governor" SIZES="10 1000000" perf/check_time.sh
#   BENCH_DIR=target/release perf/check_time.sh          # a prebuilt check_ir
#   SERIAL=1 IMPLS="ours" perf/check_time.sh             # one check at a time
#
# Each (implementation, size, round) runs perf/src/bin/check_ir.rs once
# with CHECKS checks (default 10^7); check_ir reads the process's CPU time
# (`CLOCK_PROCESS_CPUTIME_ID`) when its checks start and when they end, and
# prints the difference per check: the CPU time of one check, without the
# setup (storing 10^6 keys faults in hundreds of MB, and its time varies
# more between runs than the checks' own). For a two-thread mode, the CPU
# of both threads per check of either: the pair's checks/s ÷ one thread's
# = 2 × one thread's figure ÷ this one. CPU time counts only the time this
# process ran, so other processes on a shared host inflate it far less than
# wall-clock times (they still share its caches); implementations are
# interleaved round by round, so compare them within a round. No hardware
# counters are needed (there are none in most VMs); instructions per check
# are perf/check_ir.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
IMPLS=${IMPLS:-"ours governor pingora_rate"}
SIZES=${SIZES:-"10 10000 1000000"}
ROUNDS=${ROUNDS:-3}
CHECKS=${CHECKS:-10000000}
if [[ -z "${BENCH_DIR:-}" ]]; then
  cargo build --quiet --release -p tiered-ratelimit-perf --bin check_ir
  BENCH_DIR=target/release
fi
per_check_ns() { # impl keys -> CPU ns per check of the checks' loop
  "$BENCH_DIR/check_ir" "$1" "$2" "$CHECKS" 2>&1 >/dev/null \
    | awk '/loop cpu ns per check/ { print $NF }'
}
echo "| implementation | keys | ns per check, rounds | median |"
echo "|---|---:|---|---:|"
for n in $SIZES; do
  declare -A runs=()
  for _ in $(seq "$ROUNDS"); do
    for impl in $IMPLS; do
      runs[$impl]+="$(per_check_ns "$impl" "$n") "
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
