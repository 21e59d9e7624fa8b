#!/usr/bin/env bash
# Redis instructions per request of the product's fixed-window calls
# (issue 43, perf/README.md "Group commit"): trl_check alone (B = 1) and
# trl_batch with B requests a call, beside the lab's increment-first script
# (perf/floors/fixed_window_batch_incr.lua) and the reference's INCRBY +
# EXPIRE per key, the Envoy service's spec (limit 10^9 an hour, short
# reply), keys already in their window (perf/redis_batch_product.py
# --count). redis-server under callgrind at --hz 1, N1 and N2 requests,
# (total2 - total1) / (N2 - N1): exact, the call's fixed cost shared by B.
#
#   bench_server library-lua > lib.lua    # or any build of the library
#   LIB=lib.lua perf/batch_instructions.sh
#   SHAPES="product lab reference" KEYN="1 4" BATCHES="1 4 6 16" N1=480 N2=1920
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
for tool in valgrind callgrind_annotate redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
: "${LIB:?LIB=the library source, bench_server library-lua}"
SHAPES=${SHAPES:-"product lab reference"}
KEYN=${KEYN:-"1 4"}
BATCHES=${BATCHES:-"1 4 6 16"}
N1=${N1:-480}
N2=${N2:-1920}
bench_setup batch_instructions

count() { # SHAPE KEYS B N -> total instructions of a redis-server that answered N requests
  local port vp out=$work/cg.$1.$2.$3.$4 _
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --hz 1 \
    --dir "$work" >/dev/null 2>&1 &
  vp=$!
  for _ in $(seq 1 300); do
    redis-cli -p "$port" PING 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  python3 perf/redis_batch_product.py "$port" "$LIB" --count "$1" "$2" "$3" "$4" ||
    { stop "$vp"; echo "$1 $2 $3: failed" >&2; exit 1; }
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  callgrind_annotate "$out" 2>/dev/null |
    awk '/PROGRAM TOTALS/ && !done {gsub(",", "", $1); print $1; done = 1}'
}

echo "| keys a request | shape | requests a call | Redis instructions per request |"
echo "|---:|---|---:|---:|"
for k in $KEYN; do
  for s in $SHAPES; do
    for b in $BATCHES; do
      [[ $s == reference && $b != 1 ]] && continue
      a=$(count "$s" "$k" "$b" "$N1")
      c=$(count "$s" "$k" "$b" "$N2")
      echo "| $k | $s | $b | $(( (c - a) / (N2 - N1) )) |"
    done
  done
done
