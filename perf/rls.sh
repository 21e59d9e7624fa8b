#!/usr/bin/env bash
# ShouldRateLimit load on the Envoy rate limit service (rls/,
# docs/envoy.md): calls per second at concurrency 32, server CPU per call,
# on memory and on Redis, with 1 and 4 descriptors a call, beside a floor
# measured in the same rounds: perf/src/bin/rls_floor.rs, the same
# generated tonic server answering OK without reading the request
# (perf/README.md, "Envoy rate limit service").
#
#   perf/rls.sh                  # ~1 minute; markdown table on stdout
#   ROUNDS=3 SECONDS_PER_RUN=10 perf/rls.sh
#
# Builds tiered-ratelimit-rls, perf/src/bin/rls_floor.rs and
# perf/src/bin/rls_load.rs (release),
# starts its own redis-server on a free loopback port (never 6379) and, per
# run, a fresh server with limits nothing reaches (every call is decided and
# charged, none denied), loads it with rls_load (32 tasks, one HTTP/2
# connection each) after a 1 s warm-up, and reads the server's and Redis'
# CPU time from /proc. Client and server share the machine: the report
# prints nproc and the load average. Each round runs the floor and the
# service back to back per descriptor count, so a busy machine weighs on
# both alike; the second table divides our server CPU per call by the
# floor's (targets: <= 2x on memory; on Redis the service's own CPU,
# Redis's excluded, <= 2x).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-1}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-5}
CONCURRENCY=${CONCURRENCY:-32}

for tool in redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found on PATH" >&2; exit 1; }
done

source perf/lib.sh
bench_setup rls
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src lua rls Cargo.toml 2>/dev/null || echo '+dirty')"
log "building tiered-ratelimit-rls, rls_floor and rls_load (release)..."
cargo build --quiet --release -p tiered-ratelimit-rls --bin tiered-ratelimit-rls
cargo build --quiet --release -p tiered-ratelimit-perf --bin rls_load --bin rls_floor
rls="${CARGO_TARGET_DIR:-target}/release/tiered-ratelimit-rls"
floor="${CARGO_TARGET_DIR:-target}/release/rls_floor"
load="${CARGO_TARGET_DIR:-target}/release/rls_load"
start_redis
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

config() { # backend -> rules file
  local f="$work/rls-$1.toml"
  {
    echo 'domain = "bench"'
    echo 'key_prefix = "rls-bench"'
    [[ "$1" == redis ]] && printf '[redis]\nurl = "%s"\n' "$REDIS_URL"
    for r in "per_ip remote_address" "tenant tenant" "global generic_key"; do
      set -- $r
      printf '[[rule]]\nname = "%s"\nmatch = [{ key = "%s" }]\nlimit = 1000000000\nperiod = "1s"\n' "$1" "$2"
    done
    printf '[[rule]]\nname = "user_path"\nmatch = [{ key = "user" }, { key = "path" }]\nlimit = 1000000000\nperiod = "1s"\n'
  } >"$f"
  echo "$f"
}

results="$work/results.tsv"
: >"$results"
for round in $(seq 1 "$ROUNDS"); do
  for n in 1 4; do
    for backend in floor memory redis; do
      port=$(free_port)
      if [[ "$backend" == floor ]]; then
        "$floor" "127.0.0.1:$port" >"$work/server.out" 2>"$work/server.err" &
      else
        "$rls" --config "$(config $backend)" --listen "127.0.0.1:$port" --metrics none \
          >"$work/server.out" 2>"$work/server.err" &
      fi
      server_pid=$!
      sleep 0.5
      "$load" "127.0.0.1:$port" "$n" "$CONCURRENCY" 1 >/dev/null
      s0=$(cpu_ticks "$server_pid"); r0=$(cpu_ticks "$redis_pid")
      out=$("$load" "127.0.0.1:$port" "$n" "$CONCURRENCY" "$SECONDS_PER_RUN")
      s1=$(cpu_ticks "$server_pid"); r1=$(cpu_ticks "$redis_pid")
      stop "$server_pid"; server_pid=""
      log "$backend $n: $out"
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$backend" "$n" "$out" "$((s1 - s0))" "$((r1 - r0))" >>"$results"
    done
  done
done

python3 - "$results" "$hz" "$(nproc)" "$load_start" "$(cut -d' ' -f1-3 /proc/loadavg)" "$commit" "$CONCURRENCY" <<'PY'
import sys, statistics
path, hz, nproc, l0, l1, commit, conc = sys.argv[1:]
hz = int(hz)
rows = {}
for line in open(path):
    rnd, backend, n, out, sticks, rticks = line.rstrip("\n").split("\t")
    kv = dict(p.split("=") for p in out.split())
    calls = int(kv["calls"])
    rows.setdefault((backend, n), []).append({
        "rps": float(kv["rps"]), "p50": int(kv["p50_us"]), "p99": int(kv["p99_us"]),
        "cpu": int(sticks) * 1e6 / hz / calls, "rcpu": int(rticks) * 1e6 / hz / calls,
        "over": int(kv["over_limit"]), "err": int(kv["errors"]),
    })
print(f"* commit {commit}; {nproc} CPUs, load average {l0} → {l1}; concurrency {conc}, client on the same machine")
print()
print("| server | descriptors | calls/s | p50 µs | p99 µs | server CPU µs/call | Redis CPU µs/call | over limit / errors |")
print("|---|---|---|---|---|---|---|---|")
med = lambda rs, k: statistics.median(r[k] for r in rs)
for (backend, n), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "floor", kv[0][0])):
    m = lambda k: med(rs, k)
    redis = f"{m('rcpu'):.1f}" if backend == "redis" else "—"
    print(f"| {backend} | {n} | {m('rps'):.0f} | {m('p50'):.0f} | {m('p99'):.0f} | {m('cpu'):.1f} | "
          f"{redis} | {sum(r['over'] for r in rs)} / {sum(r['err'] for r in rs)} |")
print()
print("| ours / floor | descriptors | server CPU per call | calls/s | target (CPU) |")
print("|---|---|---|---|---|")
for n in sorted({n for _, n in rows}):
    floor = rows.get(("floor", n))
    for backend in ("memory", "redis"):
        ours = rows.get((backend, n))
        if not floor or not ours:
            continue
        # Per round, ours against the floor of the same round; the median of those.
        cpu = statistics.median(o["cpu"] / f["cpu"] for o, f in zip(ours, floor))
        rps = statistics.median(o["rps"] / f["rps"] for o, f in zip(ours, floor))
        verdict = "met" if cpu <= 2.0 else "missed"
        print(f"| {backend} | {n} | {cpu:.2f}x | {rps:.2f}x | <= 2x: {verdict} |")
PY
