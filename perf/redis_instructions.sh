#!/usr/bin/env bash
# Redis instructions per check: the call the layer sends by default against
# the plain GCRA floor script, counted by callgrind (deterministic: the
# same figure on a busy or a quiet machine, unlike perf/redis_default.sh's
# µs per call).
#
#   perf/redis_instructions.sh     # ~2 min; needs valgrind, redis-benchmark
#
# For each call shape, redis-server runs under `valgrind --tool=callgrind`,
# both libraries are loaded (`bench_server minimal4-lua` by SCRIPT LOAD,
# `bench_server library-lua` by FUNCTION LOAD), and `redis-benchmark -c 1
# -n N` sends that one call, for N = 2 000 and N = 12 000; the per-call
# figure is the difference of the two totals / 10 000 (start-up and the
# loads cancel out). The layer's shapes are what it sends by default: FCALL,
# the tier keys plus the hourly blocked-keys set, the deadline clock
# argument "-<µs>", short-reply token-bucket specs (a quota that never
# denies). Prints a markdown table with the ratio to the floor.
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
for tool in valgrind callgrind_annotate redis-server redis-cli redis-benchmark python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
bench_setup redis_instructions
build_bench_server
spec="4 1000000000000 1 1000 0 1 8"
deadline="-99999999999999999"
keys4=(rl:global:all rl:ip:127.0.0.1 rl:user:alice rl:endpoint:GET%20/)
floor_args=(1000 1000000000000)

# count LABEL N ARGS...: total instructions of a redis-server that answered
# N calls of ARGS (FLOOR and FN stand for the floor's SHA and our function).
count() {
  local label=$1 n=$2 port vp floor fn _
  shift 2
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$label.$n" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" >/dev/null 2>&1 &
  vp=$!
  for _ in $(seq 1 200); do
    redis-cli -p "$port" PING 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  floor=$(redis-cli -p "$port" SCRIPT LOAD "$("$bin" minimal4-lua)")
  "$bin" library-lua | redis-cli -p "$port" -x FUNCTION LOAD REPLACE >/dev/null
  fn=$("$bin" function-name)
  local args=("$@")
  args=("${args[@]/FLOOR/$floor}")
  args=("${args[@]/FN/$fn}")
  redis-benchmark -p "$port" -c 1 -P 1 -n "$n" -q "${args[@]}" >/dev/null 2>&1
  redis-cli -p "$port" INFO commandstats | grep -q 'failed_calls=0' ||
    { echo "$label: failed calls" >&2; exit 1; }
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  callgrind_annotate "$work/cg.$label.$n" 2>/dev/null |
    awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}'
}

per_call() { # LABEL ARGS...
  local label=$1 a b
  shift
  a=$(count "$label" 2000 "$@")
  b=$(count "$label" 12000 "$@")
  echo $(( (b - a) / 10000 ))
  log "$label: $(( (b - a) / 10000 )) instructions per call"
}

f1=$(per_call floor1 evalsha FLOOR 1 "${keys4[1]}" "${floor_args[@]}")
l1=$(per_call layer1 fcall FN 2 "${keys4[1]}" rl:blocked:h "$deadline" "$spec")
f4=$(per_call floor4 evalsha FLOOR 4 "${keys4[@]}" \
  "${floor_args[@]}" "${floor_args[@]}" "${floor_args[@]}" "${floor_args[@]}")
l4=$(per_call layer4 fcall FN 5 "${keys4[@]}" rl:blocked:h "$deadline" \
  "$spec" "$spec" "$spec" "$spec")
echo "Redis $(redis-server --version | awk '{print $3}'), code $commit"
echo
echo "| call | Redis instructions per call | × floor |"
echo "|---|---|---|"
python3 - "$f1" "$l1" "$f4" "$l4" <<'PY'
import sys
f1, l1, f4, l4 = map(int, sys.argv[1:])
for name, v, f in (("GCRA floor, 1 key", f1, f1), ("layer default, 1 tier", l1, f1),
                   ("GCRA floor, 4 keys", f4, f4), ("layer default, 4 tiers", l4, f4)):
    print(f"| {name} | {v:,} | {v / f:.2f} |")
PY
