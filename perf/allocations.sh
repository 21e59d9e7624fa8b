#!/usr/bin/env bash
# Heap allocations per request of perf/src/bin/bench_server.rs, counted by
# valgrind's memcheck: what the layer allocates around the memory check,
# whose own count (zero for a held key) tests/memory_allocations.rs asserts.
#
#   perf/allocations.sh                     # bare mem1 mem4 redis4, ~2 min
#   MODES="bare mem1" N=2000 perf/allocations.sh
#   BENCH_BIN=<path> perf/allocations.sh    # a prebuilt bench_server
#
# For each mode the server runs under `valgrind --tool=memcheck` twice, for
# WARM (200) requests and for WARM + N (default 1000), over one keep-alive
# connection (curl), and is stopped with SIGTERM; memcheck's "total heap
# usage" of the second run less the first's, divided by N, is one request's
# allocations (startup, warm-up and exit cancel out). Deterministic for a
# build. Needs valgrind, curl, redis-server, redis-cli, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-1000}
WARM=${WARM:-200}
MODES=${MODES:-"bare mem1 mem4 redis4"}

for tool in valgrind curl redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found on PATH" >&2; exit 1; }
done

source perf/lib.sh
bench_setup allocations
build_bench_server
start_redis

# allocs MODE COUNT: heap blocks allocated by a server that answered COUNT
# requests (startup and exit included).
allocs() {
  local port
  port=$(free_port)
  LISTEN_ADDR="127.0.0.1:$port" valgrind --tool=memcheck --leak-check=no \
    --log-file="$work/memcheck.$1.$2" "$bin" "$1" >"$work/server.out" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/memcheck.$1.$2" >&2; exit 1; }
    sleep 0.1
  done
  curl -s -H 'x-user: alice' -o /dev/null -w '%{http_code}\n' \
    "http://127.0.0.1:$port/?[1-$2]" >"$work/codes" || true
  [[ $(grep -c '^200' "$work/codes") -eq $2 ]] ||
    { echo "$1: not every request answered 200" >&2; exit 1; }
  stop "$server_pid"
  server_pid=""
  sed -n 's/.*total heap usage: \([0-9,]*\) allocs.*/\1/p' "$work/memcheck.$1.$2" | tr -d ,
}

echo "code $commit, $N requests per mode (memcheck, $WARM warm-up requests subtracted)"
echo
echo "| mode | allocations per request | − bare |"
echo "|---|---:|---:|"
base=""
for mode in $MODES; do
  a=$(allocs "$mode" "$WARM")
  b=$(allocs "$mode" $((WARM + N)))
  per=$(python3 -c "print(f'{($b - $a) / $N:.2f}')")
  [[ "$mode" == bare ]] && base=$per
  diff=$([[ -n "$base" ]] && python3 -c "print(f'{$per - $base:+.2f}')" || echo "n/a")
  echo "| $mode | $per | $diff |"
  log "$mode: $a -> $b allocations"
done
