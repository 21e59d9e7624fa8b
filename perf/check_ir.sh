#!/usr/bin/env bash
# Instructions per memory check (callgrind): ours, governor's keyed limiter
# (DashMap) and pingora-limits' `Rate`, at 10, 10^4 and 10^6 live keys
# `rl:ip:<IPv4>`, the work of `memory_check/<n>` in benches/hot_path.rs.
#
#   perf/check_ir.sh                        # ~2 min
#   IMPLS="ours" SIZES="10 1000000" perf/check_ir.sh
#   BENCH_DIR=target/release perf/check_ir.sh   # a prebuilt check_ir
#
# Each (implementation, size) runs perf/src/bin/check_ir.rs under
# `valgrind --tool=callgrind --cache-sim=yes` twice, with C1 and C2 checks
# (default 20 000 and 120 000): (X(C2) − X(C1)) / (C2 − C1) is one check's
# count of X, setup (filling the keys) and exit excluded: instructions (Ir),
# first-level data cache misses (D1 miss: reads and writes) and last-level
# data misses (LL miss: what goes to DRAM, the cost at 10^6 keys), in
# callgrind's model of this host's caches: its L1 as valgrind detects it,
# and the last level as Linux describes it (/sys/.../cpu0/cache/index3;
# override with LL=size,ways,line). valgrind's own detection is not used
# for the last level: on these VMs it models 256 MiB, direct-mapped, which
# makes the LL column meaningless. Exact for a build; check_time.sh has
# the time.
set -euo pipefail
cd "$(dirname "$0")/.."
IMPLS=${IMPLS:-"ours governor pingora_rate"}
SIZES=${SIZES:-"10 10000 1000000"}
C1=${C1:-20000}
C2=${C2:-120000}
command -v valgrind >/dev/null 2>&1 || { echo "valgrind not found on PATH" >&2; exit 1; }
if [[ -z "${BENCH_DIR:-}" ]]; then
  cargo build --quiet --release -p tiered-ratelimit-perf --bin check_ir
  BENCH_DIR=target/release
fi
if [[ -z "${LL:-}" ]]; then
  l3=/sys/devices/system/cpu/cpu0/cache/index3
  if [[ -r $l3/size ]]; then
    kib=$(sed 's/K$//' "$l3/size")
    ways=$(cat "$l3/ways_of_associativity") line=$(cat "$l3/coherency_line_size")
    # valgrind models only a power-of-two count of sets (a 105 MiB,
    # 15-way L3 has 114 688): round it down to one.
    sets=$((kib * 1024 / (ways * line))) pow=1
    while ((pow * 2 <= sets)); do pow=$((pow * 2)); done
    LL="$((pow * ways * line)),$ways,$line"
  fi
fi
echo "last level modelled as ${LL:-as valgrind detects it} (bytes,ways,line)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
counts() { # impl keys checks -> "Ir D1miss LLmiss" totals
  valgrind --tool=callgrind --cache-sim=yes ${LL:+--LL=$LL} --callgrind-out-file="$work/cg.out" \
    "$BENCH_DIR/check_ir" "$1" "$2" "$3" >/dev/null 2>"$work/vg.err"
  python3 - "$work/cg.out" <<'PY'
import sys
events = summary = None
for line in open(sys.argv[1]):
    if line.startswith("events:"):
        events = line.split()[1:]
    elif line.startswith("summary:"):
        summary = [int(x) for x in line.split()[1:]]
e = dict(zip(events, summary + [0] * (len(events) - len(summary))))
print(e["Ir"], e.get("D1mr", 0) + e.get("D1mw", 0), e.get("DLmr", 0) + e.get("DLmw", 0))
PY
}
echo "| implementation | keys | Ir per check | D1 misses per check | LL misses per check |"
echo "|---|---:|---:|---:|---:|"
for impl in $IMPLS; do
  for n in $SIZES; do
    read -r a1 a2 a3 < <(counts "$impl" "$n" "$C1")
    read -r b1 b2 b3 < <(counts "$impl" "$n" "$C2")
    python3 -c "d=$C2-$C1; print('| $impl | $n | %d | %.2f | %.2f |' % (($b1-$a1)/d, ($b2-$a2)/d, ($b3-$a3)/d))"
  done
done
