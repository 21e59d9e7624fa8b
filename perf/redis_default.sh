#!/usr/bin/env bash
# What a user gets by default, measured through the real path: Redis CPU
# per check of the layer as bench_server builds it with no settings (the
# builder's defaults: nothing about formats or replies is set) against the
# plain GCRA floor script, over HTTP, same run; and the size of an idle
# `ip` key of a 100/hour token bucket.
#
#   perf/redis_default.sh      # ~4 min; ROUNDS (3), N (20000 requests a
#                                 # run), CONNS (8 connections at once)
#
# One redis-server of its own. Per round, in this order, each bench_server
# mode is started with REDIS_URL only (a quota that never denies: burst
# 10^9, 1000/s), given 500 warm-up requests, then `INFO commandstats` is
# reset and N requests go through curl (`--parallel`, CONNS keep-alive
# connections, so Redis is kept busy as under real traffic; `x-user:
# alice`), and `usec_per_call` of the script call is read:
#   minimal1  the GCRA floor on the ip key (`bench_server minimal4-lua`:
#             Redis TIME, MGET, one integer TAT, SET … PX) via EVALSHA
#   redis1    the layer, 1 tier (ip), FCALL
#   minimal4  the same floor on redis4's four keys
#   redis4    the layer, 4 tiers (global, ip, user, endpoint), FCALL
# Every run must make exactly one script call per request, and every
# response must be 200. Then `bench_server redis1` with IP_PER_HOUR=100
# answers one request and the script prints `OBJECT ENCODING`, `MEMORY
# USAGE … SAMPLES 0` and `PTTL` of `rl:ip:127.0.0.1`.
#
# Prints a markdown table: the median µs per call and the ratio to the
# floor of the same round (median; every round). Redis's own CPU per call
# does not depend on how fast the client is, so BENCH_BIN (perf/lib.sh)
# may point at a debug build of bench_server.
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
ROUNDS=${ROUNDS:-3}
N=${N:-20000}
CONNS=${CONNS:-8}
for tool in redis-server redis-cli curl python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
bench_setup redis_default
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
build_bench_server
start_redis

# serve MODE [ENV=VALUE...]: bench_server MODE on a free port; sets $url.
serve() {
  local mode=$1 port _
  shift
  port=$(free_port)
  env LISTEN_ADDR="127.0.0.1:$port" "$@" "$bin" "$mode" >"$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 200); do
    grep -q '^listening on' "$work/server.log" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
    sleep 0.05
  done
  url="http://127.0.0.1:$port/"
}

# load COUNT: COUNT requests on CONNS connections; prints the count of 200s.
load() {
  curl -s --no-progress-meter -Z --parallel-max "$CONNS" -o /dev/null -w '%{http_code}\n' \
    -H 'x-user: alice' "$url?[1-$1]" | grep -c '^200$'
}

results="$work/results.tsv"
for round in $(seq 1 "$ROUNDS"); do
  for mode in minimal1 redis1 minimal4 redis4; do
    rcli FLUSHALL >/dev/null
    serve "$mode"
    load 500 >/dev/null
    rcli CONFIG RESETSTAT >/dev/null
    ok=$(load "$N")
    read -r calls usec < <(rcli INFO commandstats | tr -d '\r' |
      awk -F'[:=,]' '/^cmdstat_(evalsha|fcall):/ {print $3, $7}')
    stop "$server_pid"
    server_pid=""
    [[ "$ok" == "$N" ]] || { echo "$mode: $ok of $N answered 200" >&2; exit 1; }
    [[ "$calls" == "$N" ]] || { echo "$mode: $calls script calls for $N requests" >&2; exit 1; }
    printf '%s\t%s\t%s\n' "$round" "$mode" "$usec" >>"$results"
    log "round $round $mode: $usec µs per call"
  done
done

rcli FLUSHALL >/dev/null
serve redis1 IP_PER_HOUR=100
load 1 >/dev/null
key=rl:ip:127.0.0.1
idle="$(rcli OBJECT ENCODING "$key") $(rcli MEMORY USAGE "$key" SAMPLES 0) $(rcli PTTL "$key") $(rcli GET "$key")"
stop "$server_pid"
server_pid=""

{
  echo "redis=$(redis-server --version | awk '{print $3}')"
  echo "cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo) x $(nproc)"
  echo "load=$load_start -> $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "commit=$commit"
  echo "conns=$CONNS"
  echo "idle=$idle"
} >"$work/facts"
python3 - "$results" "$work/facts" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
facts = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[2]) if "=" in l)
us = {}
for rnd, mode, u in rows:
    us.setdefault(mode, {})[rnd] = float(u)
print(f"Redis {facts['redis']}, {facts['cpu']}, load {facts['load']}, code {facts['commit']}, "
      f"{facts['conns']} connections\n")
print("| check, over HTTP | Redis µs per call (median; rounds) | × floor, same round (median; rounds) |")
print("|---|---|---|")
for floor, ours, what in (("minimal1", "redis1", "1 tier"), ("minimal4", "redis4", "4 tiers")):
    for mode in (floor, ours):
        v = us[mode]
        ratios = [v[r] / us[floor][r] for r in sorted(v)]
        name = f"GCRA floor, {what} (`{mode}`)" if mode == floor else f"the layer's defaults, {what} (`{mode}`)"
        print(f"| {name} | {statistics.median(v.values()):.2f} ({', '.join(f'{v[r]:.2f}' for r in sorted(v))}) | "
              f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) |")
enc, size, pttl, value = facts["idle"].split()
print(f"\nIdle `rl:ip:127.0.0.1` of `redis1` with `IP_PER_HOUR=100`, after one request: "
      f"{enc}, {size} B (`MEMORY USAGE … SAMPLES 0`), PTTL {pttl} ms, value {value}")
PY
