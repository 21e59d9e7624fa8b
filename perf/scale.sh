#!/usr/bin/env bash
# Scale test: 10^6 distinct users against 10, same run, on Redis (default)
# or on the memory backend (perf/README.md, "Scale: 10^6 users against
# Redis" and "Scale: 10^6 keys on the memory backend").
#
#   perf/scale.sh                        # Redis, ~2 minutes; markdown report on stdout
#   BACKEND=memory perf/scale.sh         # memory backend, ~3 minutes
#   ROUNDS=5 DURATION=15 perf/scale.sh   # longer, steadier
#   USERS=100000 perf/scale.sh           # another population
#
# Builds perf/src/bin/bench_server.rs (release), starts one bench_server in
# mode redis4 (BACKEND=redis: tiers global, ip, user from `x-user`,
# endpoint, on its own redis-server on a free loopback port below 32768,
# never 6379, no persistence) or mem4 (BACKEND=memory: the same tiers on
# the memory backend) on another, loads it with wrk on 127.0.0.1 and stops
# everything it started on exit, whatever happens.
#
# The user tier has a real quota, so its keys expire: on Redis
# USER_QUOTA_PER_MINUTE=$USER_QUOTA (default 10), on memory
# USER_QUOTA_PER_HOUR=$USER_QUOTA_HOUR (default 1); burst USER_BURST
# (default 10^7 on Redis, 10^6 on memory: a burst times the period in µs
# stays under 2^52). A token bucket's key lives until the bucket is full
# again: k requests leave a key for k × 60 000 / USER_QUOTA ms (6 s each by
# default) or k × 3 600 000 / USER_QUOTA_HOUR ms (an hour) after its last
# write, whatever the burst. The burst only keeps the hot users of phase (a) from
# ever being denied; nothing may be denied in either phase (the report
# flags any non-2xx). The global, ip and endpoint tiers keep bench_server's
# never-denying quota (their keys persist).
#
# Phases, ROUNDS (default 3) × [(a), (b)], each `wrk -t1 -c$CONNS
# -d${DURATION}s --latency` with a Lua script drawing `x-user` per request:
#  (a) uniformly from HOT_USERS (default 10) users h1..h10;
#  (b) uniformly from USERS (default 10^6) users u1..u1000000.
#
# BACKEND=redis, per phase: req/s, p50/p99, non-2xx, server and Redis CPU
# per request, EVALSHA calls ÷ requests (INFO commandstats). Same-round
# ratio (b)/(a). Around each (b): used_memory and DBSIZE read together (one
# EVAL) before and after: bytes per new key, Redis overhead included;
# MEMORY USAGE (SAMPLES 0), value length and PTTL of SAMPLE (default 1000)
# `rl:user:u*` keys, each PTTL compared with what its stored bucket implies.
# After the last (b): the longest PTTL of any `rl:user:u*` key, then DBSIZE,
# INFO keyspace and the `rl:user:u*` keys SCAN still sees at that TTL + 1 s
# and + 5 s.
#
# BACKEND=memory: bench_server runs with PROMETHEUS=1 (its `GET /_metrics`,
# outside the limiter: the check-duration histogram in buckets 2^(1/8)
# apart, and the store's key count, `MemoryBackend::len`) and MAX_KEYS
# (default 1 100 000: above the 10^6 + 13 keys of the run, so nothing is
# evicted; MAX_KEYS=1000000, bench_server's default, shows the flood at
# the bound). Before the first (b), a fill (PREFILL=1, the default; 0
# skips it) sends every user u1..u$USERS one request, in order, until the
# store holds their keys, so every (b) finds all 10^6 held (at an hour a
# request none expires during the run; the first (a) runs on an empty
# store, the later ones beside the 10^6); the report shows the key count
# read before and after each phase. Per phase:
# req/s, p50/p99, non-2xx, server CPU per request, the server's VmRSS
# after it, and the p50/p90/p99 and mean of `part="backend"` check
# durations (the store's check alone, between two clock reads) recorded
# during the phase (bucket counts diffed between the scrapes around it).
# Same-round (b) ÷ (a) and (b) − (a).
#
# Needs: wrk (Debian: apt-get install wrk), python3, a Linux /proc (CPU
# time, RSS); BACKEND=redis: redis-server, redis-cli (Debian: redis-server,
# redis-tools); BACKEND=memory: curl. Other load on the machine skews the
# absolute numbers: the report prints nproc and the load average; the
# same-round ratio is the number to compare.
set -euo pipefail
cd "$(dirname "$0")/.."

BACKEND=${BACKEND:-redis}
USERS=${USERS:-1000000}
HOT_USERS=${HOT_USERS:-10}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-12}
CONNS=${CONNS:-32}
USER_QUOTA=${USER_QUOTA:-10}
USER_QUOTA_HOUR=${USER_QUOTA_HOUR:-1}
SAMPLE=${SAMPLE:-1000}
case "$BACKEND" in
  redis) USER_BURST=${USER_BURST:-10000000}; tools="wrk redis-server redis-cli python3" ;;
  # per_hour(1): burst × 3.6e9 µs must stay under 2^52 (Quota's bound).
  memory) USER_BURST=${USER_BURST:-1000000}; tools="wrk curl python3" ;;
  *) echo "BACKEND must be redis or memory" >&2; exit 1 ;;
esac

for tool in $tools; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "$tool not found on PATH (Debian: apt-get install wrk redis-server redis-tools curl python3)" >&2
    exit 1
  }
done

source perf/lib.sh
bench_setup scale

build_bench_server

# bench_server in mode $1 with the environment "NAME=value" ... that
# follows, on a free port (five tries): sets sport, server_pid and url.
start_server() { # mode env...
  local mode=$1
  shift
  server_pid=""
  for _ in 1 2 3 4 5; do
    sport=$(free_port)
    env LISTEN_ADDR="127.0.0.1:$sport" "$@" "$bin" "$mode" >"$work/server.out" 2>"$work/server.err" &
    server_pid=$!
    for _ in $(seq 1 200); do
      grep -q "listening on" "$work/server.out" 2>/dev/null && break
      kill -0 "$server_pid" 2>/dev/null || break
      sleep 0.025
    done
    grep -q "listening on" "$work/server.out" 2>/dev/null && break
    stop "$server_pid"
    server_pid=""
  done
  [[ -n "$server_pid" ]] || { echo "bench_server did not start:" >&2; cat "$work/server.err" >&2; exit 1; }
  url="http://127.0.0.1:$sport/"
}

# x-user drawn uniformly from <prefix>1 .. <prefix><n> per request:
#   wrk ... -s users.lua <url> -- <n> <prefix>
cat >"$work/users.lua" <<'LUA'
local n, prefix = 10, "u"
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end
function init(args)
  n = tonumber(args[1]) or n
  prefix = args[2] or prefix
  -- A seed per thread and per run: each run draws other users.
  math.randomseed(os.time() * 1000 + (thread_id or 0) * 7919 + n)
  for _ = 1, 10 do math.random() end
end
local headers = {}
function request()
  headers["x-user"] = prefix .. math.random(1, n)
  return wrk.format(nil, nil, headers)
end
LUA

# ---------------------------------------------------------------- memory
# BACKEND=memory: the same two populations against bench_server mem4 on the
# memory backend, with the store pre-filled before each (b) so that every
# (b) request finds its user's key held among 10^6.
if [[ "$BACKEND" == memory ]]; then
  MAX_KEYS=${MAX_KEYS:-1100000}
  PREFILL=${PREFILL:-1}
  start_server mem4 PROMETHEUS=1 MAX_KEYS="$MAX_KEYS" \
    USER_QUOTA_PER_HOUR="$USER_QUOTA_HOUR" USER_BURST="$USER_BURST"
  log "bench_server mem4 on port $sport (pid $server_pid), user quota $USER_QUOTA_HOUR/hour, burst $USER_BURST, max_keys $MAX_KEYS"

  # Users <prefix>1 .. <prefix><n> in order, one request each (then around
  # again), sending no more once n + 64 responses are in (wrk then idles
  # until -d runs out: fill() ends it once the store holds every key).
  cat >"$work/fill.lua" <<'LUA'
local n, prefix, i, done = 10, "u", 0, 0
function init(args)
  n = tonumber(args[1]) or n
  prefix = args[2] or prefix
end
local headers = {}
function request()
  i = i % n + 1
  headers["x-user"] = prefix .. i
  return wrk.format(nil, nil, headers)
end
function response(status)
  done = done + 1
  if done >= n + 64 then wrk.thread:stop() end
end
LUA
  # The server's /_metrics into $1; prints "keys rss_kb".
  scrape() { # file
    curl -sf "http://127.0.0.1:$sport/_metrics" >"$1"
    printf '%s %s\n' "$(awk '/^bench_server_memory_keys / {print $2}' "$1")" \
      "$(awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status")"
  }
  results="$work/results.tsv"
  : >"$results"
  # One measured wrk run between two scrapes; appends to $results:
  #   phase round users requests seconds rps non2xx p50 p99 sock_err
  #   cpu_us/req keys_before keys_after rss_kb_after
  measure_mem() { # phase round users prefix
    local phase=$1 round=$2 users=$3 prefix=$4 k0 k1 rss
    read -r k0 _ < <(scrape "$work/m_${round}_${phase}_0.txt")
    wrk_measure -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$work/users.lua" "$url" \
      -- "$users" "$prefix"
    read -r k1 rss < <(scrape "$work/m_${round}_${phase}_1.txt")
    printf '%s\t' "$phase" "$round" "$users" "$req" "$secs" "$rps" "$non" "$p50" "$p99" \
      "$sock_err" "$cpu_us" "$k0" "$k1" >>"$results"
    printf '%s\n' "$rss" >>"$results"
    log "$(tail -n1 "$results")"
  }
  # Fills the store: wrk in the background until the store holds
  # USERS + HOT_USERS + 3 keys (every user's, the hot users' and the global,
  # ip and endpoint tiers'), or its count stops growing for 5 s, or 600 s.
  fill() { # round
    local t0 k rss wrk_pid last=-1 still=0 _
    t0=$(date +%s.%N)
    wrk -t1 -c"$CONNS" -d600s -s "$work/fill.lua" "$url" -- "$USERS" u >"$work/fill.out" 2>&1 &
    wrk_pid=$!
    while kill -0 "$wrk_pid" 2>/dev/null; do
      sleep 0.5
      read -r k _ < <(scrape "$work/fill_poll.txt")
      ((k >= USERS + HOT_USERS + 3)) && break
      if ((k == last)); then ((++still < 10)) || break; else still=0; fi
      last=$k
    done
    kill -INT "$wrk_pid" 2>/dev/null || true
    wait "$wrk_pid" 2>/dev/null || true
    read -r k rss < <(scrape "$work/m_$1_fill.txt")
    printf 'fill\t%s\t%s\t%s\t%s\t%s\n' "$1" "$(wrk_parse "$work/fill.out" | cut -d' ' -f1)" \
      "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')" "$k" "$rss" \
      >>"$work/fill.tsv"
    log "$(tail -n1 "$work/fill.tsv")"
  }
  : >"$work/fill.tsv"
  read -r _ rss0 < <(scrape "$work/m_start.txt")
  load_start=$(cut -d' ' -f1-3 /proc/loadavg)
  t_start=$(date +%s)
  wrk -t1 -c"$CONNS" -d1s -s "$work/users.lua" "$url" -- "$HOT_USERS" h >/dev/null 2>&1
  for ((round = 1; round <= ROUNDS; round++)); do
    log "round $round: $HOT_USERS users, then $USERS users"
    measure_mem hot "$round" "$HOT_USERS" h
    ((round > 1)) || [[ "$PREFILL" == 0 ]] || fill "$round"
    measure_mem cold "$round" "$USERS" u
  done
  hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$server_pid/status")
  # Of which in transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1
  # asks for them where /sys/kernel/mm/transparent_hugepage is "madvise").
  huge=$(awk '/^AnonHugePages:/ {print $2}' "/proc/$server_pid/smaps_rollup" 2>/dev/null || echo 0)
  {
    run_facts
    echo "users=$USERS"
    echo "hot_users=$HOT_USERS"
    echo "rounds=$ROUNDS"
    echo "duration=$DURATION"
    echo "conns=$CONNS"
    echo "user_quota=$USER_QUOTA_HOUR"
    echo "user_burst=$USER_BURST"
    echo "max_keys=$MAX_KEYS"
    echo "prefill=$PREFILL"
    echo "rss_start=$rss0"
    echo "hwm=$hwm"
    echo "huge=${huge:-0}"
    echo "tunables=${GLIBC_TUNABLES:-}"
  } >"$work/meta.txt"
  python3 - "$results" "$work/meta.txt" "$work/fill.tsv" "$work" <<'PY'
import math, re, statistics as st, sys
from collections import defaultdict
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
meta = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[2]) if "=" in l)
fills = [l.rstrip("\n").split("\t") for l in open(sys.argv[3]) if l.strip()]
work = sys.argv[4]
F = ["phase", "round", "users", "req", "secs", "rps", "non2xx", "p50", "p99", "sockerr",
     "cpu", "k0", "k1", "rss"]
rows = [dict(zip(F, r)) for r in rows]
for r in rows:
    for k in F[2:]:
        r[k] = float(r[k])
med = lambda xs: st.median(xs) if xs else float("nan")
fmt = lambda n: f"{n:,.0f}".replace(",", " ")
NAME = "tiered_ratelimit_check_duration_seconds"

def hist(path, part):
    """Cumulative bucket counts {le: n}, sum and count of one part."""
    b, s, c = {}, 0.0, 0
    for line in open(path):
        if not line.startswith(NAME) or f'part="{part}"' not in line:
            continue
        v = float(line.rsplit(" ", 1)[1])
        if line.startswith(NAME + "_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            b[float("inf") if le == "+Inf" else float(le)] = v
        elif line.startswith(NAME + "_sum"):
            s = v
        elif line.startswith(NAME + "_count"):
            c = v
    return b, s, c

def phase_hist(rnd, phase, part):
    b0, s0, c0 = hist(f"{work}/m_{rnd}_{phase}_0.txt", part)
    b1, s1, c1 = hist(f"{work}/m_{rnd}_{phase}_1.txt", part)
    les = sorted(b1)
    return [(le, b1[le] - b0.get(le, 0)) for le in les], s1 - s0, c1 - c0

def quantile(buckets, q):
    """Interpolated geometrically inside the bucket that holds rank q·n."""
    n = buckets[-1][1]
    if n <= 0:
        return float("nan")
    rank, prev_le, prev_n = q * n, buckets[0][0] / 2 ** 0.125, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return float("inf")
            f = (rank - prev_n) / (cum - prev_n) if cum > prev_n else 1.0
            return prev_le * (le / prev_le) ** f
        prev_le, prev_n = le, cum
    return float("nan")

for r in rows:
    for part in ("backend", "total"):
        b, s, c = phase_hist(int(r["round"]), r["phase"], part)
        r[part] = {"n": c, "mean": s / c * 1e9 if c else float("nan"),
                   **{q: quantile(b, q) * 1e9 for q in (0.5, 0.9, 0.99)}}
users, hot = int(meta["users"]), int(meta["hot_users"])
q = int(meta["user_quota"])
print(f"# Scale, memory backend: {fmt(users)} users against {hot} ({meta['elapsed']} s)\n")
print(f"* machine: {meta['nproc']} CPUs ({meta['cpu']}), load average "
      f"{meta['load_start']} at start, {meta['load_end']} at end (shared machine)")
print(f"* code: {meta['commit']}; wrk {meta['wrk']}; bench_server mem4 (global, ip, user, "
      f"endpoint), `PROMETHEUS=1`, `MAX_KEYS={meta['max_keys']}`; user tier "
      f"`Quota::per_hour({q}).burst({meta['user_burst']})` (a key lives "
      f"{3600 / q:.0f} s a request after its last), the others never deny")
print(f"* {meta['rounds']} rounds × [{hot} users, "
      + ("in round 1 a fill, every one of the " + fmt(users) + " users once, in order; "
         if meta["prefill"] != "0" else "")
      + f"{fmt(users)} users], each measured phase `wrk -t1 -c{meta['conns']} "
      f"-d{meta['duration']}s --latency`, `x-user` drawn uniformly per request\n")
print("| round | users | keys held before → after | req/s | p50 µs | p99 µs | non-2xx | "
      "server CPU µs/req | RSS after MB | backend check p50 / p90 / p99 ns | mean ns | "
      "total p50 ns |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    b, t = r["backend"], r["total"]
    print(f"| {r['round']} | {fmt(r['users'])} | {fmt(r['k0'])} → {fmt(r['k1'])} | {fmt(r['rps'])} | "
          f"{r['p50']:.0f} | {r['p99']:.0f} | {r['non2xx']:.0f} | {r['cpu']:.2f} | "
          f"{r['rss'] / 1024:.1f} | {b[0.5]:.0f} / {b[0.9]:.0f} / {b[0.99]:.0f} | {b['mean']:.0f} | "
          f"{t[0.5]:.0f} |")
by = defaultdict(dict)
for r in rows:
    by[r["round"]][r["phase"]] = r
pairs = [p for p in by.values() if "cold" in p and "hot" in p]
def line(label, f, form):
    xs = [f(p["hot"], p["cold"]) for p in pairs]
    print(f"| {label} | **{form(med(xs))}** | {', '.join(form(x) for x in xs)} |")
print(f"\n| same round, (b) {fmt(users)} users against (a) {hot} | median | rounds |")
print("|---|---|---|")
line("backend check p50, (b) ÷ (a)", lambda a, b: b["backend"][0.5] / a["backend"][0.5], lambda x: f"{x:.2f}")
line("backend check p90, (b) ÷ (a)", lambda a, b: b["backend"][0.9] / a["backend"][0.9], lambda x: f"{x:.2f}")
line("backend check p99, (b) ÷ (a)", lambda a, b: b["backend"][0.99] / a["backend"][0.99], lambda x: f"{x:.2f}")
line("backend check mean, (b) − (a), ns", lambda a, b: b["backend"]["mean"] - a["backend"]["mean"], lambda x: f"{x:+.0f}")
line("server CPU µs/req, (b) ÷ (a)", lambda a, b: b["cpu"] / a["cpu"], lambda x: f"{x:.3f}")
line("server CPU µs/req, (b) − (a)", lambda a, b: b["cpu"] - a["cpu"], lambda x: f"{x:+.2f}")
line("req/s, (b) ÷ (a)", lambda a, b: b["rps"] / a["rps"], lambda x: f"{x:.3f}")
non = sum(r["non2xx"] for r in rows)
errs = sum(r["sockerr"] for r in rows)
print(f"\nNon-2xx responses over the measured phases: **{non:.0f}**; socket errors: {errs:.0f}.")
if fills:
    print("\nFills (every user once, in order; keys held and RSS right after):\n")
    print("| round | requests | seconds | keys held after | RSS MB |")
    print("|---|---|---|---|---|")
    for _, rnd, req, secs, k, rss in fills:
        print(f"| {rnd} | {fmt(float(req))} | {secs} | {fmt(float(k))} | {int(rss) / 1024:.1f} |")
cold = [r for r in rows if r["phase"] == "cold"]
if cold:
    print(f"\nRSS: {int(meta['rss_start']) / 1024:.1f} MB at start (empty store), "
          f"{med([r['rss'] for r in cold]) / 1024:.1f} MB after the (b) phases (median), "
          f"peak (VmHWM) {int(meta['hwm']) / 1024:.1f} MB, of which "
          f"{int(meta['huge']) / 1024:.0f} MB in huge pages at the end"
          + (f" (`GLIBC_TUNABLES={meta['tunables']}`)" if meta['tunables'] else "")
          + "; keys held in (b): "
          f"{fmt(min(r['k0'] for r in cold))}–{fmt(max(r['k1'] for r in cold))} "
          f"(`MemoryBackend::len`, expired not yet swept included).")
print("\nCheck times: the `part=\"backend\"` histogram, from just before the store's check "
      "to just after it (two `Instant::now` reads), diffed between scrapes; "
      "buckets 2^(1/8) apart, quantiles interpolated inside a bucket (±4.5 %).")
print("\n<details><summary>raw rows</summary>\n")
print("| " + " | ".join(F) + " |")
print("|" + "---|" * len(F))
for r in rows:
    print("| " + " | ".join(str(r[k]) for k in F) + " |")
print("\n</details>")
PY
  exit 0
fi

# ------------------------------------------------------------------- redis
start_redis

# ------------------------------------------------------------------ server
start_server redis4 REDIS_URL="redis://127.0.0.1:$rport/" \
  USER_QUOTA_PER_MINUTE="$USER_QUOTA" USER_BURST="$USER_BURST"
log "bench_server redis4 on port $sport (pid $server_pid), user quota $USER_QUOTA/min, burst $USER_BURST"

# ------------------------------------------------------------------ helpers

# used_memory and DBSIZE at one instant, and Redis's clock in µs.
snap() {
  rcli EVAL "local m = string.match(redis.call('INFO', 'memory'), 'used_memory:(%d+)')
local t = redis.call('TIME')
return {m, redis.call('DBSIZE'), t[1] * 1000000 + t[2]}" 0 | paste -sd' '
}
# Up to $1 keys matching $2, one line each: key, MEMORY USAGE SAMPLES 0,
# STRLEN, PTTL, Redis TIME in µs right before and right after the PTTL (PTTL
# reads the clock, not the script's start time), value.
sample_keys() { # count pattern
  rcli EVAL "local out, cursor = {}, '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[2], 'COUNT', 1000)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    if #out < tonumber(ARGV[1]) then
      local v = redis.call('GET', k)
      if v then
        local t0 = redis.call('TIME')
        local p = redis.call('PTTL', k)
        local t1 = redis.call('TIME')
        out[#out + 1] = k .. ' ' .. redis.call('MEMORY', 'USAGE', k, 'SAMPLES', '0') .. ' ' ..
          #v .. ' ' .. p .. ' ' .. string.format('%.0f %.0f', t0[1] * 1000000 + t0[2],
          t1[1] * 1000000 + t1[2]) .. ' ' .. v
      end
    end
  end
until cursor == '0' or #out >= tonumber(ARGV[1])
return out" 0 "$1" "$2"
}
# Every key matching $1: "count max_pttl_ms" (SCAN skips expired keys).
scan_pttl() { # pattern
  rcli EVAL "local n, max, cursor = 0, -1, '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 10000)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    local p = redis.call('PTTL', k)
    if p >= 0 then n = n + 1; if p > max then max = p end end
  end
until cursor == '0'
return {n, max}" 0 "$1" | paste -sd' '
}
keyspace() { # -> "keys expires"
  rcli INFO keyspace | tr -d '\r' | awk -F'[:=,]' '/^db0:/ {print $3, $5; f=1} END {if (!f) print 0, 0}'
}
expired_keys() {
  rcli INFO stats | tr -d '\r' | awk -F: '/^expired_keys:/ {print $2}'
}

results="$work/results.tsv"
mem="$work/memory.tsv"
samples="$work/samples.txt"
expiry="$work/expiry.tsv"
: >"$results"; : >"$mem"; : >"$samples"; : >"$expiry"

# One measured wrk run. Appends to $results:
#   phase round users requests seconds rps non2xx p50 p99 sock_err
#   cpu_us/req redis_cpu_us/req evalsha/req
measure() { # phase round users prefix
  local phase=$1 round=$2 users=$3 prefix=$4
  wrk_measure -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$work/users.lua" "$url" \
    -- "$users" "$prefix"
  printf '%s\t' "$phase" "$round" "$users" "$req" "$secs" "$rps" "$non" "$p50" "$p99" \
    "$sock_err" "$cpu_us" "$redis_us" >>"$results"
  printf '%s\n' "$evalsha_per" >>"$results"
  log "$(tail -n1 "$results")"
}

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
t_start=$(date +%s)
rcli FLUSHALL >/dev/null
rcli CONFIG RESETSTAT >/dev/null
wrk -t1 -c"$CONNS" -d1s -s "$work/users.lua" "$url" -- "$HOT_USERS" h >/dev/null 2>&1
expired0=$(expired_keys)

# ----------------------------------------------------------------- phases
for ((round = 1; round <= ROUNDS; round++)); do
  log "round $round: $HOT_USERS users, then $USERS users"
  measure hot "$round" "$HOT_USERS" h
  read -r m0 k0 _ < <(snap)
  measure cold "$round" "$USERS" u
  read -r m1 k1 now_us < <(snap)
  printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$m0" "$k0" "$m1" "$k1" >>"$mem"
  { echo "round $round"; sample_keys "$SAMPLE" 'rl:user:u*'; } >>"$samples"
done

# ------------------------------------------------------------------ expiry
# The longest-lived user key from the (b) phases, then the keys left at its
# expiry + 1 s and + 5 s. Physical counts first (DBSIZE, INFO keyspace: keys
# not yet reclaimed included), then SCAN (which skips, and deletes, keys
# whose TTL has passed).
read -r live max_pttl < <(scan_pttl 'rl:user:u*')
t0=$(python3 -c 'import time; print(time.time())')
log "after the load: $live rl:user:u* keys, longest PTTL $max_pttl ms"
expiry_row() { # label
  local dbs ks ex s
  dbs=$(rcli DBSIZE)
  ks=$(keyspace | tr ' ' '\t')
  ex=$(expired_keys)
  s=$(scan_pttl 'rl:user:u*' | tr ' ' '\t')
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" \
    "$(python3 -c "import time; print(round(time.time() - $t0, 2))")" "$dbs" "$ks" "$((ex - expired0))" "$s" \
    >>"$expiry"
  log "$(tail -n1 "$expiry")"
}
expiry_row "right after the load"
hot_keys=$(rcli EVAL "local out = {}
for _, k in ipairs(redis.call('KEYS', 'rl:user:h*')) do out[#out + 1] = k .. ' ' .. redis.call('PTTL', k) end
return out" 0 | paste -sd';')
other_keys=$(rcli EVAL "local out = {}
for _, k in ipairs(redis.call('KEYS', '*')) do
  if not string.match(k, '^rl:user:') then out[#out + 1] = k .. ' ' .. redis.call('PTTL', k) end
end
return out" 0 | paste -sd';')
for extra in 1 5; do
  python3 -c "import time; time.sleep(max(0, $t0 + $max_pttl / 1000 + $extra - time.time()))"
  expiry_row "longest TTL + $extra s"
done
read -r m_end k_end _ < <(snap)


# ----------------------------------------------------------------- report
{
  run_facts
  echo "users=$USERS"
  echo "hot_users=$HOT_USERS"
  echo "rounds=$ROUNDS"
  echo "duration=$DURATION"
  echo "conns=$CONNS"
  echo "user_quota=$USER_QUOTA"
  echo "user_burst=$USER_BURST"
  echo "max_pttl=$max_pttl"
  echo "live_after=$live"
  echo "hot_keys=$hot_keys"
  echo "other_keys=$other_keys"
  echo "mem_end=$m_end"
  echo "keys_end=$k_end"
} >"$work/meta.txt"

python3 - "$results" "$work/meta.txt" "$mem" "$samples" "$expiry" <<'EOF'
import math, statistics as st, sys
from collections import defaultdict
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
meta = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[2]) if "=" in l)
mem = [l.split() for l in open(sys.argv[3]) if l.strip()]
expiry = [l.rstrip("\n").split("\t") for l in open(sys.argv[5]) if l.strip()]
F = ["phase", "round", "users", "req", "secs", "rps", "non2xx", "p50", "p99", "sockerr",
     "cpu", "rcpu", "evalsha"]
rows = [dict(zip(F, r)) for r in rows]
for r in rows:
    for k in F[2:]:
        r[k] = float(r[k])
med = lambda xs: st.median(xs) if xs else float("nan")
n_quota, burst = int(meta["user_quota"]), int(meta["user_burst"])
users, hot = int(meta["users"]), int(meta["hot_users"])
# The user tier's bucket (src/algorithm/token_bucket.rs): per minute.
period_us = 60_000_000
g = math.gcd(n_quota, period_us)
unit, rate = period_us // g, n_quota // g
one_ms = math.ceil(math.ceil(unit / rate) / 1000)  # PX after one request

def fmt(n):
    return f"{n:,.0f}".replace(",", " ")

def tat_us(v):
    """The TAT (epoch µs) of a stored bucket, as lua/common.lua's tat_value
    writes it: `<tat>` (rate 1), `<tat><3-digit code>` (rate up to 44: 19
    digits or more) or `<tat>:<frac>:<rate>`."""
    if ":" in v:
        return int(v.split(":")[0])
    return int(v) if int(v) < 10**18 else int(v[:-3])

print(f"# Scale: {fmt(users)} users against {hot} ({meta['elapsed']} s)\n")
print(f"* machine: {meta['nproc']} CPUs ({meta['cpu']}), load average "
      f"{meta['load_start']} at start, {meta['load_end']} at end (shared machine)")
print(f"* code: {meta['commit']}; redis-server {meta['redis']}; wrk {meta['wrk']}; "
      f"bench_server redis4 (global, ip, user, endpoint); user tier "
      f"`Quota::per_minute({n_quota}).burst({burst})`, the others never deny")
print(f"* {meta['rounds']} rounds × [{hot} users, {fmt(users)} users], each "
      f"`wrk -t1 -c{meta['conns']} -d{meta['duration']}s --latency`, `x-user` drawn "
      f"uniformly per request by a Lua script\n")

print("| round | users | req/s | p50 µs | p99 µs | non-2xx | socket errors | server CPU µs/req | "
      "Redis CPU µs/req | EVALSHA/req |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['round']} | {fmt(r['users'])} | {fmt(r['rps'])} | {r['p50']:.0f} | {r['p99']:.0f} | "
          f"{r['non2xx']:.0f} | {r['sockerr']:.0f} | {r['cpu']:.1f} | {r['rcpu']:.1f} | "
          f"{r['evalsha']:.3f} |")
by = defaultdict(dict)
for r in rows:
    by[r["round"]][r["phase"]] = r
ratios = [p["cold"]["rps"] / p["hot"]["rps"] for p in by.values() if "cold" in p and "hot" in p]
p50d = [p["cold"]["p50"] - p["hot"]["p50"] for p in by.values() if "cold" in p and "hot" in p]
p99d = [p["cold"]["p99"] - p["hot"]["p99"] for p in by.values() if "cold" in p and "hot" in p]
g_ = lambda ph, k: med([r[k] for r in rows if r["phase"] == ph])
print()
print("| | median |  rounds |")
print("|---|---|---|")
print(f"| req/s, {fmt(users)} users / {hot} users | **{med(ratios):.3f}** | "
      f"{', '.join(f'{x:.3f}' for x in ratios)} |")
print(f"| p50, {fmt(users)} − {hot} users, µs | {med(p50d):+.0f} | {', '.join(f'{x:+.0f}' for x in p50d)} |")
print(f"| p99, {fmt(users)} − {hot} users, µs | {med(p99d):+.0f} | {', '.join(f'{x:+.0f}' for x in p99d)} |")
print(f"| Redis CPU µs/req, {hot} / {fmt(users)} users | {g_('hot', 'rcpu'):.1f} / {g_('cold', 'rcpu'):.1f} | |")
print(f"| server CPU µs/req, {hot} / {fmt(users)} users | {g_('hot', 'cpu'):.1f} / {g_('cold', 'cpu'):.1f} | |")
non = sum(r["non2xx"] for r in rows)
errs = sum(r["sockerr"] for r in rows)
print(f"\nNon-2xx responses over the whole run: **{non:.0f}**; socket errors: {errs:.0f}. "
      f"EVALSHA per request: {min(r['evalsha'] for r in rows):.3f}–{max(r['evalsha'] for r in rows):.3f}.")

print(f"\n## Memory, after each {fmt(users)}-user phase\n")
print("`used_memory` and `DBSIZE` read in one `EVAL` before and right after the phase "
      "(keys whose TTL had passed but not yet reclaimed count in both):\n")
print("| round | keys before | keys after | new keys | used_memory Δ | bytes per new key |")
print("|---|---|---|---|---|---|")
for rnd, m0, k0, m1, k1 in mem:
    m0, k0, m1, k1 = map(int, (m0, k0, m1, k1))
    dk = k1 - k0
    per = f"{(m1 - m0) / dk:.0f}" if dk > 0 else "–"
    print(f"| {rnd} | {fmt(k0)} | {fmt(k1)} | {fmt(dk)} | {fmt(m1 - m0)} B | **{per}** |")

# Samples: per round, keys with MEMORY USAGE, STRLEN, PTTL, Redis µs before
# and after the PTTL, value.
rounds, cur = {}, None
for line in open(sys.argv[4]):
    parts = line.split()
    if not parts:
        continue
    if parts[0] == "round":
        cur = parts[1]; rounds[cur] = []
    else:
        rounds[cur].append(parts)
print(f"\n`MEMORY USAGE … SAMPLES 0` of up to {max((len(v) for v in rounds.values()), default=0)} "
      "`rl:user:u*` keys (SCAN order) right after each phase, and their PTTL against the TTL "
      "their stored bucket implies (its TAT, the instant it is full again, less the read's time; "
      "Redis TIME read just before and after each PTTL, expected at the midpoint; off = outside "
      "that bracket by more than PX's rounding up and Redis's whole ms, −1 to +2 ms):\n")
print("| round | keys | MEMORY USAGE min / median / max B | key length | value length | "
      "PTTL median / max ms | PTTL − expected, ms (min … max) | keys off | "
      "requests behind full, max |")
print("|---|---|---|---|---|---|---|---|---|")
example = None
for rnd, ks in rounds.items():
    if not ks:
        print(f"| {rnd} | 0 | | | | | | | |")
        continue
    mu = [int(k[1]) for k in ks]
    kl = [len(k[0]) for k in ks]
    vl = [int(k[2]) for k in ks]
    pt = [int(k[3]) for k in ks]
    diffs, behind, outside = [], [], 0
    for k in ks:
        before, now = int(k[4]), int(k[5])
        tat = tat_us(k[6])
        # PX is the time until the TAT rounded up to ms, and Redis keeps
        # whole ms: PTTL is the TAT less the read's time, from 1 ms under
        # to 2 ms over.
        expected = (tat - (before + now) / 2) / 1000
        pttl = int(k[3])
        diffs.append(pttl - expected)
        if not ((tat - now) / 1000 - 1 <= pttl <= (tat - before) / 1000 + 2):
            outside += 1
        behind.append(max(0, tat - now) * n_quota / period_us)
        if example is None:
            example = (k, expected)
    dmin = min(diffs) if diffs else float("nan")
    dmax = max(diffs) if diffs else float("nan")
    print(f"| {rnd} | {len(ks)} | {min(mu)} / {st.median(mu):.0f} / {max(mu)} | "
          f"{min(kl)}–{max(kl)} | {min(vl)}–{max(vl)} | {st.median(pt):.0f} / {max(pt)} | "
          f"{dmin:+.1f} … {dmax:+.1f} | {outside} | {max(behind):.2f} |" if behind else "")
print(f"\nOne request leaves a key for {one_ms} ms (`per_minute({n_quota})`: one token per "
      f"{60_000 / n_quota:.0f} ms; PX = time to full, rounded up to ms).")
if example:
    k, expected = example
    print(f"Example: `{k[0]}` = `{k[6]}` (TAT {tat_us(k[6])} µs), {int(k[1])} B, PTTL {k[3]} ms; "
          f"{expected:.1f} ms expected.")

print(f"\n## Expiry\n")
print(f"Right after the load {fmt(int(meta['live_after']))} `rl:user:u*` keys were live, the longest "
      f"PTTL {meta['max_pttl']} ms. Non-user keys: {meta['other_keys'].replace(';', ', ')} "
      f"(PTTL ms); the {hot} hot users' keys: "
      f"{', '.join(x.split()[1] for x in meta['hot_keys'].split(';') if x)} ms "
      f"(their buckets are {g_('hot', 'req') * int(meta['rounds']) / hot:.0f}-odd requests "
      f"behind full, refilled at one per {60_000 / n_quota:.0f} ms).\n")
print("| when | s after the load | DBSIZE | keyspace keys | keyspace expires | keys expired so far "
      "(`expired_keys`) | `rl:user:u*` keys SCAN sees | their longest PTTL ms |")
print("|---|---|---|---|---|---|---|---|")
for label, t, dbs, keys, exp, expd, live, mx in expiry:
    print(f"| {label} | {t} | {fmt(int(dbs))} | {fmt(int(keys))} | {fmt(int(exp))} | {fmt(int(expd))} | "
          f"{fmt(int(live))} | {mx if int(live) else '–'} |")
if mem:
    print(f"\n`used_memory` at the end: {fmt(int(meta['mem_end']))} B for {meta['keys_end']} keys "
          f"(before the first {fmt(users)}-user phase: {fmt(int(mem[0][1]))} B for {mem[0][2]} keys).")

print("\n<details><summary>raw rows</summary>\n")
print("| " + " | ".join(F) + " |")
print("|" + "---|" * len(F))
for r in rows:
    print("| " + " | ".join(str(r[k]) for k in F) + " |")
print("\n</details>")
EOF
