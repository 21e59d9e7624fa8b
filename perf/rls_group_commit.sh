#!/usr/bin/env bash
# Group commit in the product (issue 43): the Envoy rate limit service
# (rls/) on fixed-window rules, limits never reached, 16 concurrent
# clients (perf/src/bin/rls_load.rs), 1 and 4 descriptors a request, with
# group commit on (the default) and off (`[redis] max_batch = 1`), beside
# envoyproxy/ratelimit's command pattern sent to the same Redis by 16
# clients (perf/redis_batch.py reference: INCRBY + EXPIRE per descriptor,
# pipelined per request). Per run: CONFIG RESETSTAT, then
#   command µs per request  usec of cmdstat_fcall (the reference: incrby +
#                           expire) / requests
#   CPU µs per request      used_cpu_user_main_thread + used_cpu_sys_main_thread
#                           gained / requests (INFO cpu: I/O included)
#   calls per request       calls of cmdstat_fcall / requests
# and, per round, one client alone (concurrency 1) against the service, on
# and off: its p50 (the low-load latency, same round).
#
#   perf/rls_group_commit.sh        # ~3 min; ROUNDS=3 SECONDS_PER_RUN=5 N_REF=32000
#
# Medians of ROUNDS rounds; ratios to the same round's reference. Client,
# service and Redis share the machine: the report prints nproc and the load.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-5}
N_REF=${N_REF:-32000}

for tool in redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found on PATH" >&2; exit 1; }
done

source perf/lib.sh
bench_setup rls_group_commit
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src lua rls Cargo.toml 2>/dev/null || echo '+dirty')"
log "building tiered-ratelimit-rls and rls_load (release)..."
cargo build --quiet --release -p tiered-ratelimit-rls --bin tiered-ratelimit-rls
cargo build --quiet --release -p tiered-ratelimit-perf --bin rls_load
rls="${CARGO_TARGET_DIR:-target}/release/tiered-ratelimit-rls"
load="${CARGO_TARGET_DIR:-target}/release/rls_load"
start_redis
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

config() { # on|off -> rules file: fixed windows of 10^9 an hour
  local f="$work/rls-$1.toml"
  {
    echo 'domain = "bench"'
    echo 'key_prefix = "rls-bench"'
    printf '[redis]\nurl = "%s"\n' "$REDIS_URL"
    [[ "$1" == off ]] && echo 'max_batch = 1'
    for r in "per_ip remote_address" "tenant tenant" "global generic_key"; do
      set -- $r
      printf '[[rule]]\nname = "%s"\nmatch = [{ key = "%s" }]\nlimit = 1000000000\nperiod = "1h"\nalgorithm = "fixed_window"\n' "$1" "$2"
    done
    printf '[[rule]]\nname = "user_path"\nmatch = [{ key = "user" }, { key = "path" }]\nlimit = 1000000000\nperiod = "1h"\nalgorithm = "fixed_window"\n'
  } >"$f"
  echo "$f"
}

rcli() { redis-cli -p "$rport" "$@"; }
stat() { # -> "fcall_calls fcall_usec cpu_us"
  python3 - "$(rcli INFO commandstats)" "$(rcli INFO cpu)" <<'PY'
import sys, re
cs, cpu = sys.argv[1], sys.argv[2]
m = re.search(r"cmdstat_fcall:calls=(\d+),usec=(\d+)", cs)
calls, usec = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
f = lambda k: float(re.search(k + r":([\d.]+)", cpu).group(1))
print(calls, usec, round((f("used_cpu_user_main_thread") + f("used_cpu_sys_main_thread")) * 1e6))
PY
}

results="$work/results.tsv"
: >"$results"
for round in $(seq 1 "$ROUNDS"); do
  for n in 1 4; do
    read -r _ u c < <(python3 perf/redis_batch.py "$rport" "$N_REF" reference "$n" --stats)
    printf '%s\treference\t%s\t%s\t%s\t%s\t0\t0\n' "$round" "$n" "$N_REF" "$u" "$c" >>"$results"
    for mode in on off; do
      port=$(free_port)
      "$rls" --config "$(config $mode)" --listen "127.0.0.1:$port" --metrics none \
        >"$work/server.out" 2>"$work/server.err" &
      server_pid=$!
      sleep 0.5
      "$load" "127.0.0.1:$port" "$n" 16 1 >/dev/null
      rcli FLUSHALL >/dev/null
      rcli CONFIG RESETSTAT >/dev/null
      read -r _ _ c0 < <(stat)
      out=$("$load" "127.0.0.1:$port" "$n" 16 "$SECONDS_PER_RUN")
      read -r calls usec c1 < <(stat)
      one=$("$load" "127.0.0.1:$port" "$n" 1 "$SECONDS_PER_RUN")
      stop "$server_pid"; server_pid=""
      reqs=$(sed -E 's/.*calls=([0-9]+).*/\1/' <<<"$out")
      p50=$(sed -E 's/.*p50_us=([0-9]+).*/\1/' <<<"$one")
      log "round $round, $n descriptors, group commit $mode: $out; alone: $one"
      python3 -c "import sys; r,u,k,c=map(float,sys.argv[1:]); print(f'$round\t$mode\t$n\t{int(r)}\t{u/r:.3f}\t{c/r:.3f}\t{k/r:.4f}\t$p50')" \
        "$reqs" "$usec" "$calls" "$((c1 - c0))" >>"$results"
    done
  done
done

python3 - "$results" "$(nproc)" "$load_start" "$(cut -d' ' -f1-3 /proc/loadavg)" "$commit" "$ROUNDS" <<'PY'
import sys, statistics as st
path, nproc, l0, l1, commit, rounds = sys.argv[1:]
rows = {}
for line in open(path):
    rnd, mode, n, reqs, us, cpu, calls, p50 = line.rstrip("\n").split("\t")
    rows.setdefault((mode, n), {})[rnd] = (float(us), float(cpu), float(calls), int(p50))
print(f"* commit {commit}; Redis main thread; {nproc} CPUs, load {l0} → {l1}; medians of {rounds} rounds")
print()
print("| descriptors | shape | command µs / request | × ref | main-thread CPU µs / request | × ref | script calls / request | p50 µs, one client alone |")
print("|---:|---|---:|---:|---:|---:|---:|---:|")
names = {"reference": "reference (INCRBY + EXPIRE)", "on": "rls, group commit (default)", "off": "rls, max_batch = 1"}
for n in ("1", "4"):
    ref = rows[("reference", n)]
    for mode in ("reference", "on", "off"):
        r = rows[(mode, n)]
        med = lambda i: st.median(v[i] for v in r.values())
        ratio = lambda i: st.median(r[k][i] / ref[k][i] for k in r)
        calls = "–" if mode == "reference" else f"{med(2):.3f}"
        p50 = "–" if mode == "reference" else f"{med(3):.0f}"
        print(f"| {n} | {names[mode]} | {med(0):.2f} | {ratio(0):.2f} | {med(1):.2f} | {ratio(1):.2f} | {calls} | {p50} |")
PY
