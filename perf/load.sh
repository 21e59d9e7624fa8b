#!/usr/bin/env bash
# HTTP load test of the rate-limit layer against bare axum, tower_governor
# (without and with its headers) and minimal one-EVALSHA Redis middlewares
# (one key; redis4's four keys) (perf/README.md).
#
#   perf/load.sh                    # ~5 minutes; markdown report on stdout
#   ROUNDS=5 D32=10 perf/load.sh    # longer, steadier
#   MODES="bare mem4" perf/load.sh  # a subset (ratios need their modes)
#
# Builds perf/src/bin/bench_server.rs (release), starts its own redis-server on a
# free loopback port (never 6379; no persistence) and, for each mode, a fresh
# bench_server on another free port, loads it with wrk on 127.0.0.1 and stops
# it. Everything it starts is stopped on exit, whatever happens.
#
# Phases:
#  1. Rounds (ROUNDS, default 3) over MODES, the order alternating (A B C ..,
#     .. C B A, ...): per mode a 1 s warm-up, `wrk -t1 -c32 -d${D32}s
#     --latency` (throughput, p50/p99, server CPU per request, Redis CPU and
#     EVALSHA calls per request) and `wrk -t1 -c1 -d${D1}s --latency` (p50
#     at one connection).
#  2. Denials: each limiter with a per-IP limit of 10/s (all but ~10 requests
#     a second get 429), once each.
#  3. Deny cache flood, redis4, single key, with the deny cache and without
#     (DENY_CACHE=0): paced (10 connections, 0-20 ms between requests: ~10x
#     an ip limit of 100/s) and closed loop (32 connections, the ip limit a tenth
#     of what a pilot run reached). Redis calls per request and per denied
#     request.
#  4. Redis alone: `redis-benchmark -P 1 -n 200000 evalsha` of the minimal
#     middleware's script; Redis µs per call of the minimal script and of the
#     layer's script with 0, 1 and 4 token-bucket tiers; MEMORY USAGE of the
#     idle keys one request leaves (redis4 and minimal); used_memory per key
#     over 100 000 such keys.
#
# Needs: wrk (Debian: apt-get install wrk), redis-server, redis-cli,
# redis-benchmark (Debian: redis-server, redis-tools), curl, python3 (the
# report), a Linux /proc (CPU time). Other load on the machine skews the
# absolute numbers: the report prints nproc and the load average; the
# same-round ratios are the numbers to compare.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
D32=${D32:-5}
D1=${D1:-3}
# minimal_pool (a deadpool checkout per request) is not in the default set:
# MODES="minimal minimal_pool redis4" compares the two ways to share
# connections. minimal4 is redis4's floor (its four keys and quotas in one
# plain script), governor_headers tower_governor with its X-RateLimit headers
# on (mem1 sends its headers too).
# redis4_lease (global and endpoint tiers in lease mode) and
# redis4_lease_all (all four) are lease mode (src/token_lease.rs): each of
# their rows also reads the server's lease counters (GET /_lease) before and
# after the run, for the lease table of the report.
MODES=${MODES:-"bare bare_auth mem1 mem4 governor governor_headers redis1 redis4 redis4_lease redis4_lease_all minimal minimal4"}
# DENY_MODES="" skips the denial phase.
DENY_MODES=${DENY_MODES-"mem1 mem4 governor governor_headers redis1 redis4 minimal minimal4"}
OUT=${OUT:-}

for tool in wrk redis-server redis-cli redis-benchmark curl python3; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "$tool not found on PATH (Debian: apt-get install wrk redis-server redis-tools curl python3)" >&2
    exit 1
  }
done

source perf/lib.sh
bench_setup load

build_bench_server

# ------------------------------------------------------------------- redis
start_redis

# ------------------------------------------------------------------ helpers
start_server() { # mode [deny]; extra env through the environment
  local port
  port=$(free_port)
  LISTEN_ADDR="127.0.0.1:$port" "$bin" "$@" >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  for _ in $(seq 1 200); do
    if grep -q "listening on" "$work/server.out" 2>/dev/null; then
      server_port=$port
      return 0
    fi
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.025
  done
  echo "bench_server $* did not start:" >&2
  cat "$work/server.err" >&2
  exit 1
}
stop_server() { stop "$server_pid"; server_pid=""; }
# One measured wrk run against the running server. Appends a row to $results.
#   phase round mode conns requests seconds rps non2xx p50 p99 cpu_us/req
#   redis_cpu_us/req evalsha/req
measure() { # phase round mode conns duration
  local phase=$1 round=$2 mode=$3 conns=$4 dur=$5 l0="" l1
  if [[ "$mode" == *_lease* ]]; then l0=$(curl -s "http://127.0.0.1:$server_port/_lease"); fi
  wrk_measure -t1 -c"$conns" -d"${dur}s" --latency -H 'x-user: alice' \
    ${WRK_EXTRA[@]+"${WRK_EXTRA[@]}"} "http://127.0.0.1:$server_port/"
  printf '%s\t' "$phase" "$round" "$mode" "$conns" "$req" "$secs" "$rps" "$non" "$p50" \
    "$p99" "$cpu_us" "$redis_us" >>"$results"
  printf '%s\n' "$evalsha_per" >>"$results"
  log "$(tail -n1 "$results")"
  if [[ -n "$l0" ]]; then
    # Lease counters over the run: calls, tokens taken, returned, admitted
    # from leases (src/token_lease.rs LeaseCounts).
    l1=$(curl -s "http://127.0.0.1:$server_port/_lease")
    read -r a0 b0 c0 d0 <<<"$l0"
    read -r a1 b1 c1 d1 <<<"$l1"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$phase" "$round" "$mode" "$conns" "$req" \
      "$secs" "$((a1 - a0))" "$((b1 - b0))" "$((c1 - c0))" "$non" >>"$work/lease.tsv"
  fi
}

WRK_EXTRA=()
results="$work/results.tsv"
: >"$results"
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
t_start=$(date +%s)

# --------------------------------------------------------- phase 1: rounds
read -r -a modes <<<"$MODES"
for ((round = 1; round <= ROUNDS; round++)); do
  order=("${modes[@]}")
  if ((round % 2 == 0)); then
    order=()
    for ((i = ${#modes[@]} - 1; i >= 0; i--)); do order+=("${modes[i]}"); done
  fi
  log "round $round: ${order[*]}"
  for mode in "${order[@]}"; do
    rcli FLUSHALL >/dev/null
    start_server "$mode"
    wrk -t1 -c32 -d1s "http://127.0.0.1:$server_port/" -H 'x-user: alice' >/dev/null 2>&1
    measure rounds "$round" "$mode" 32 "$D32"
    measure rounds "$round" "$mode" 1 "$D1"
    stop_server
  done
done

# ------------------------------------------------------- phase 2: denials
log "denials (per-IP limit 10/s)"
for mode in $DENY_MODES; do
  rcli FLUSHALL >/dev/null
  DENY_RATE=10 start_server "$mode" deny
  wrk -t1 -c32 -d1s "http://127.0.0.1:$server_port/" -H 'x-user: alice' >/dev/null 2>&1
  measure deny 1 "$mode" 32 "$D32"
  stop_server
done

# ---------------------------------------------- phase 3: deny cache flood
# (a) Paced: 10 connections, each waiting a random 0-20 ms between requests
#     (~950/s offered, ~10x) against an ip limit of 100/s. (A fixed 10 ms
#     delay phase-locks the connections to the 10 ms token interval: they
#     arrive together just after each token, all miss the cache at once.)
# (b) Closed loop: 32 connections as fast as they go, the ip limit set to a
#     tenth of the rate a 2 s pilot run reached.
cat >"$work/paced.lua" <<'LUA'
function delay() return math.random(0, 20) end
LUA
for cache in default 0; do
  if [[ "$cache" == 0 ]]; then export DENY_CACHE=0; fi
  rcli FLUSHALL >/dev/null
  DENY_RATE=100 start_server redis4 deny
  wrk -t1 -c10 -d1s "http://127.0.0.1:$server_port/" -H 'x-user: alice' >/dev/null 2>&1
  WRK_EXTRA=(-s "$work/paced.lua")
  measure "flood:100:cache=$cache" 1 redis4 10 "$D32"
  WRK_EXTRA=()
  stop_server
  unset DENY_CACHE
done
pilot_rate=$(awk -F'\t' '$1 == "rounds" && $3 == "redis4" && $4 == 32 {print int($7 / 10)}' "$results" | sort -n | head -n1)
if [[ -n "$pilot_rate" && "$pilot_rate" -gt 10 ]]; then
  DENY_RATE=$pilot_rate start_server redis4 deny
  wrk -t1 -c32 -d2s "http://127.0.0.1:$server_port/" -H 'x-user: alice' >"$work/wrk.out" 2>&1
  stop_server
  read -r preq psecs _ < <(wrk_parse "$work/wrk.out")
  flood_rate=$(python3 -c "print(max(10, int($preq / $psecs / 10)))")
  log "flood: redis4, ip limit $flood_rate/s"
  for cache in default 0; do
    if [[ "$cache" == 0 ]]; then export DENY_CACHE=0; fi
    rcli FLUSHALL >/dev/null
    DENY_RATE=$flood_rate start_server redis4 deny
    wrk -t1 -c32 -d1s "http://127.0.0.1:$server_port/" -H 'x-user: alice' >/dev/null 2>&1
    measure "flood:$flood_rate:cache=$cache" 1 redis4 32 "$D32"
    stop_server
    unset DENY_CACHE
  done
fi

# --------------------------------------------------- phase 4: Redis alone
sha=$(rcli SCRIPT LOAD "$("$bin" minimal-lua)")
log "redis-benchmark evalsha $sha"
redis-benchmark -p "$rport" -P 1 -n 200000 -q evalsha "$sha" 1 bench:key 1000000000 1000000000 \
  2>/dev/null | tr '\r' '\n' | grep -a "requests per second" | tail -n1 >"$work/rb.out" || true
rb=$(sed -E 's/.*: ([0-9.]+) requests per second.*/\1/' "$work/rb.out")

# Idle keys after one request each (every tier 1/s: the keys live 1 s;
# read at once).
rcli FLUSHALL >/dev/null
memory_rows=""
for mode in redis4 minimal minimal4; do
  DENY_RATE=1 OTHER_RATE=1 start_server "$mode" deny
  curl -s -o /dev/null -H 'x-user: alice' "http://127.0.0.1:$server_port/"
  for key in $(rcli --scan); do
    memory_rows+="$mode"$'\t'"$key"$'\t'"$(rcli MEMORY USAGE "$key" SAMPLES 0)"$'\t'"$(rcli STRLEN "$key")"$'\t'"$(rcli OBJECT ENCODING "$key")"$'\n'
  done
  if [[ "$mode" == redis4 ]]; then
    # The real cost of 100 000 such keys (expires dict and hash tables
    # included, which MEMORY USAGE leaves out): used_memory before and after.
    value=$(rcli GET rl:ip:127.0.0.1)
  fi
  stop_server
  rcli FLUSHALL >/dev/null
done
per_key=""
if [[ -n "${value:-}" ]]; then
  used() { rcli INFO memory | tr -d '\r' | awk -F: '/^used_memory:/ {print $2}'; }
  m0=$(used)
  rcli EVAL "for i = 0, 99999 do redis.call('SET', 'rl:ip:10.' .. (i % 250) .. '.' .. math.floor(i / 250) % 250 .. '.' .. math.floor(i / 62500), ARGV[1], 'PX', 3600000) end return 1" 0 "$value" >/dev/null
  m1=$(used)
  per_key=$(((m1 - m0) / 100000))
  rcli FLUSHALL >/dev/null
fi

# The layer's check alone, as the redis runs above call it (FCALL of its
# Functions library, loaded by them), token bucket tiers with the
# never-denying quota (burst 10^9, 1000/s: capacity 10^12 units, rate 1
# unit/µs, 1000 units a token), compact format, short reply (flags 4 + 8,
# as the layer sends them). ARGV: clock ("" = Redis
# TIME), then one spec per tier: "<algorithm> <p1..p4> <cost> <flags>".
# perf/redis_cpu.sh compares it with the four-key floor in more rounds.
fn=$("$bin" function-name)
spec="4 1000000000000 1 1000 0 1 12"
script_rows=""
bench_script() { # label args...
  local label=$1 rate usec
  shift
  rcli CONFIG RESETSTAT >/dev/null
  rate=$(redis-benchmark -p "$rport" -P 1 -n 100000 -q "$@" 2>/dev/null | tr '\r' '\n' |
    grep -a "requests per second" | tail -n1 | sed -E 's/.*: ([0-9.]+) requests per second.*/\1/')
  usec=$(rcli INFO commandstats | tr -d '\r' | awk -F'[:=,]' '/^cmdstat_(evalsha|fcall):/ {print $7}')
  script_rows+="$label"$'\t'"$rate"$'\t'"$usec"$'\n'
}
bench_script "minimal script, 1 key" evalsha "$sha" 1 bench:min 1000 1000000000
bench_script "layer check (FCALL), 0 tiers" fcall "$fn" 0 ""
bench_script "layer check (FCALL), 1 tier" fcall "$fn" 1 rl:ip:127.0.0.1 "" "$spec"
bench_script "layer check (FCALL), 4 tiers" fcall "$fn" 4 rl:global:all rl:ip:127.0.0.1 \
  rl:user:alice rl:endpoint:GET%20/ "" "$spec" "$spec" "$spec" "$spec"
rcli FLUSHALL >/dev/null


# ----------------------------------------------------------------- report
{
  run_facts
  echo "redis_benchmark=$rb"
  echo "used_memory_per_key=$per_key"
  echo "rounds=$ROUNDS d32=$D32 d1=$D1"
} >"$work/meta.txt"
printf '%s' "$memory_rows" >"$work/memory.tsv"
printf '%s' "$script_rows" >"$work/scripts.tsv"

touch "$work/lease.tsv"
python3 - "$results" "$work/meta.txt" "$work/memory.tsv" "$work/scripts.tsv" "$work/lease.tsv" <<'EOF'
import sys, statistics as st
from collections import defaultdict
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
meta = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[2]) if "=" in l)
mem = [l.rstrip("\n").split("\t") for l in open(sys.argv[3]) if l.strip()]
scripts = [l.rstrip("\n").split("\t") for l in open(sys.argv[4]) if l.strip()]
leases = [l.rstrip("\n").split("\t") for l in open(sys.argv[5]) if l.strip()]
F = ["phase", "round", "mode", "conns", "req", "secs", "rps", "non2xx", "p50", "p99",
     "cpu", "rcpu", "evalsha"]
rows = [dict(zip(F, r)) for r in rows]
for r in rows:
    for k in F[3:]:
        r[k] = float(r[k])
med = lambda xs: st.median(xs) if xs else float("nan")
by = defaultdict(list)  # (mode, conns) -> rounds
rounds = defaultdict(dict)  # (round, conns) -> mode -> row
for r in rows:
    if r["phase"] == "rounds":
        by[(r["mode"], r["conns"])].append(r)
        rounds[(r["round"], r["conns"])][r["mode"]] = r
modes = list(dict.fromkeys(r["mode"] for r in rows if r["phase"] == "rounds"))

print(f"# Load test ({meta['elapsed']} s)\n")
print(f"* machine: {meta['nproc']} CPUs ({meta['cpu']}), load average "
      f"{meta['load_start']} at start, {meta['load_end']} at end (shared machine)")
print(f"* code: {meta['commit']}; redis-server {meta['redis']}; wrk {meta['wrk']}; "
      f"{meta['rounds']}\n")
print("## Medians over rounds\n")
print("| mode | req/s, 32 conns | p50 µs | p99 µs | server CPU µs/req | Redis CPU µs/req | "
      "EVALSHA/req | p50 µs, 1 conn | req/s, 1 conn |")
print("|---|---|---|---|---|---|---|---|---|")
for m in modes:
    a, b = by[(m, 32.0)], by[(m, 1.0)]
    g = lambda rs, k: med([r[k] for r in rs])
    print(f"| {m} | {g(a,'rps'):.0f} | {g(a,'p50'):.0f} | {g(a,'p99'):.0f} | {g(a,'cpu'):.1f} | "
          f"{g(a,'rcpu'):.1f} | {g(a,'evalsha'):.3f} | {g(b,'p50'):.0f} | {g(b,'rps'):.0f} |")

def ratio(num, den, conns=32.0, key="rps"):
    xs = [rs[num][key] / rs[den][key] for (rd, c), rs in rounds.items()
          if c == conns and num in rs and den in rs and rs[den][key]]
    return xs
def diff(num, den, conns, key):
    return [rs[num][key] - rs[den][key] for (rd, c), rs in rounds.items()
            if c == conns and num in rs and den in rs]
print("\n## Same-round ratios and differences (median; every round in brackets)\n")
print("| comparison | median | rounds |")
print("|---|---|---|")
for num, den in [("mem1", "bare"), ("mem4", "bare"), ("mem4", "bare_auth"), ("bare_auth", "bare"), ("mem1", "governor"), ("mem4", "governor"),
                 ("governor", "bare"), ("redis1", "bare"), ("redis4", "bare"),
                 ("redis1", "minimal"), ("redis4", "minimal"), ("minimal", "bare"),
                 ("minimal_pool", "minimal"), ("redis4", "minimal_pool"),
                 ("redis4", "minimal4"), ("mem1", "governor_headers"),
                 ("governor_headers", "governor"), ("minimal4", "minimal"),
                 ("redis4_lease", "redis4"), ("redis4_lease_all", "mem4"),
                 ("redis4_lease_all", "redis4")]:
    xs = ratio(num, den)
    if xs:
        print(f"| req/s {num} / {den} | {med(xs):.3f} | {', '.join(f'{x:.3f}' for x in xs)} |")
for m in modes:
    if m == "bare":
        continue
    for conns, key, label in [(1.0, "p50", "p50 at 1 conn"), (32.0, "p99", "p99 at 32 conns"),
                              (32.0, "p50", "p50 at 32 conns")]:
        xs = diff(m, "bare", conns, key)
        if xs:
            print(f"| {label}: {m} − bare, µs | {med(xs):+.0f} | {', '.join(f'{x:+.0f}' for x in xs)} |")

for num, den in [("mem1", "bare"), ("mem4", "bare"), ("mem4", "bare_auth"),
                 ("mem1", "governor_headers"), ("redis1", "minimal1"), ("redis1", "minimal")]:
    xs = diff(num, den, 32.0, "cpu")
    if xs:
        print(f"| server CPU/req: {num} − {den}, µs | {med(xs):+.1f} | {', '.join(f'{x:+.1f}' for x in xs)} |")
for num, den in [("redis4_lease", "redis4")]:
    xs = ratio(num, den, key="rcpu")
    if xs:
        print(f"| Redis CPU/req {num} / {den} | {med(xs):.3f} | {', '.join(f'{x:.3f}' for x in xs)} |")

if leases:
    # Every row's quota never denies: a 429 there is a false denial.
    print("\n## Lease mode (every run of the rounds)\n")
    print("| mode | conns | round | req/s | lease calls/s | lease calls/req | tokens taken/s | "
          "tokens returned | false denials |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ph, rd, m, c, req, secs, calls, taken, ret, non in leases:
        req, secs = float(req), float(secs)
        print(f"| {m} | {c} | {rd} | {req / secs:.0f} | {float(calls) / secs:.1f} | "
              f"{float(calls) / req:.5f} | {float(taken) / secs:.0f} | {ret} | {non} |")

other = [r for r in rows if r["phase"] != "rounds"]
if other:
    print("\n## Denials and the deny cache (one run each)\n")
    print("| run | mode | req/s | denied | server CPU µs/req | Redis CPU µs/req | EVALSHA/req | "
          "EVALSHA per denied req |")
    print("|---|---|---|---|---|---|---|---|")
    for r in other:
        denied = r["non2xx"]
        allowed = r["req"] - denied
        calls = r["evalsha"] * r["req"]
        per_denied = (calls - allowed) / denied if denied and r["evalsha"] else 0.0
        run = r["phase"]
        if run.startswith("flood:"):
            _, rate, cache = run.split(":")
            how = ("paced, 10 conns, 0-20 ms apart" if r["conns"] == 10
                   else "closed loop, 32 conns")
            run = (f"flood ({how}), ip limit {rate}/s, offered {r['rps'] / float(rate):.1f}× it, "
                   f"deny {cache}")
        print(f"| {run} | {r['mode']} | {r['rps']:.0f} | {100 * denied / r['req']:.1f} % | "
              f"{r['cpu']:.1f} | {r['rcpu']:.1f} | {r['evalsha']:.3f} | {per_denied:.3f} |")

print(f"\n## Redis alone\n")
print(f"* `redis-benchmark -P 1 -n 200000 evalsha` (minimal script, 50 clients): "
      f"{meta['redis_benchmark']} calls/s")
if scripts:
    print("\n| `redis-benchmark -P 1 -n 100000` (50 clients) | calls/s | Redis µs per call |")
    print("|---|---|---|")
    for label, rate, usec in scripts:
        print(f"| {label} | {rate} | {usec} |")
    print()
if meta.get("used_memory_per_key"):
    print(f"* `used_memory` per key, 100 000 keys `rl:ip:10.x.y.z` (13-16 characters) "
          f"holding the value of `rl:ip:127.0.0.1`, TTL 1 h: {meta['used_memory_per_key']} B")
if mem:
    print("\n| after one request | key | MEMORY USAGE (SAMPLES 0) | value bytes | encoding |")
    print("|---|---|---|---|---|")
    for m in mem:
        print("| " + " | ".join(f"`{x}`" if i == 1 else x for i, x in enumerate(m)) + " |")

print("\n<details><summary>raw rows</summary>\n")
print("| " + " | ".join(F) + " |")
print("|" + "---|" * len(F))
for r in rows:
    print("| " + " | ".join(str(r[k]) for k in F) + " |")
print("\n</details>")
EOF
if [[ -n "$OUT" ]]; then cp "$results" "$OUT"; fi
