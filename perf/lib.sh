# Shared by perf/load.sh, perf/scale.sh and perf/callgrind.sh:
# free ports, a work directory, stopping what was started, a throwaway
# redis-server. Source it from the repository root.

# A free loopback port in 20000-32767: below Linux's ephemeral range (where a
# port the kernel hands out to an outgoing connection could be taken again)
# and never 6379.
free_port() {
  python3 - <<'PY'
import random, socket
for _ in range(500):
    p = random.randint(20000, 32767)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
    break
else:
    raise SystemExit("no free port")
PY
}

# bench_setup NAME: a work directory ($work), the pids to stop on exit
# ($redis_pid, $server_pid), and log() prefixed with NAME.
bench_setup() {
  bench_name=$1
  work=$(mktemp -d "${TMPDIR:-/tmp}/$1-bench.XXXXXX")
  redis_pid=""
  server_pid=""
  trap bench_cleanup EXIT
  trap 'exit 130' INT TERM
}

log() { echo "[$bench_name] $*" >&2; }

stop() { # pid
  if [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; then
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
  fi
}

bench_cleanup() {
  stop "$server_pid"
  stop "$redis_pid"
  if [[ -n "${KEEP:-}" ]]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}

# start_redis: a redis-server of our own (no persistence) on a free port:
# sets $rport, $redis_pid, rcli() and exports REDIS_URL.
start_redis() {
  local started="" _
  for _ in 1 2 3 4 5; do
    rport=$(free_port)
    redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no \
      --daemonize no --dir "$work" --logfile "$work/redis.log" &
    redis_pid=$!
    for _ in $(seq 1 100); do
      kill -0 "$redis_pid" 2>/dev/null || break
      if redis-cli -p "$rport" PING 2>/dev/null | grep -q PONG; then started=1; break; fi
      sleep 0.05
    done
    [[ -n "$started" ]] && break
    stop "$redis_pid"
  done
  [[ -n "$started" ]] || { echo "redis-server did not start" >&2; exit 1; }
  export REDIS_URL="redis://127.0.0.1:$rport/"
  log "redis-server $(redis-server --version | awk '{print $3}') on port $rport (pid $redis_pid)"
}

rcli() { redis-cli -p "$rport" "$@"; }

# build_bench_server: perf/src/bin/bench_server.rs in release; sets $bin and
# $commit (the code measured: HEAD, "+dirty" if src/, lua/ or Cargo.toml
# differ from it).
#
# BENCH_BIN=<path>: run that bench_server instead (say a copy built at the
# commit before a change, to measure before and after side by side); the
# report's commit is then BENCH_COMMIT (default "prebuilt").
build_bench_server() {
  if [[ -n "${BENCH_BIN:-}" ]]; then
    bin=$BENCH_BIN
    commit=${BENCH_COMMIT:-prebuilt}
    [[ -x "$bin" ]] || { echo "no binary at $bin" >&2; exit 1; }
    log "running the prebuilt $bin ($commit)"
    return
  fi
  commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src lua Cargo.toml 2>/dev/null || echo '+dirty')"
  log "building perf/src/bin/bench_server.rs (release)..."
  cargo build --quiet --release -p tiered-ratelimit-perf --bin bench_server
  bin="${CARGO_TARGET_DIR:-target}/release/bench_server"
  [[ -x "$bin" ]] || { echo "no binary at $bin" >&2; exit 1; }
}

# CPU time of a process: utime + stime in clock ticks ($hz per second;
# fields 14 and 15 of /proc/<pid>/stat, after the command name, which may
# hold spaces).
hz=$(getconf CLK_TCK)
cpu_ticks() { # pid
  sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}

# Script calls so far: EVALSHA (the minimal middlewares, a cluster, refunds)
# plus FCALL (the layer's check on Redis >= 7).
evalsha_calls() {
  rcli INFO commandstats | tr -d '\r' |
    awk -F'[:=,]' '/^cmdstat_(evalsha|fcall):/ {n += $3} END {print n + 0}'
}

# A wrk --latency report -> "requests seconds non2xx p50_us p99_us socket_errors".
wrk_parse() { # file -> "requests seconds non2xx p50_us p99_us socket_errors"
  awk '
    function us(v) {
      if (v ~ /us$/) return v + 0; if (v ~ /ms$/) return v * 1000;
      if (v ~ /s$/) return v * 1000000; return v + 0 }
    / 50%/ {p50 = us($2)} / 99%/ {p99 = us($2)}
    / requests in / {req = $1; d = $4; sub(/s,$/, "", d); if (d ~ /m$/) d = d * 60}
    /Non-2xx or 3xx responses/ {non = $5}
    /Socket errors/ {gsub(/,/, ""); err = $4 + $6 + $8 + $10}
    END {printf "%d %s %d %s %s %d\n", req, d + 0, non + 0, p50 + 0, p99 + 0, err + 0}' "$1"
}

# wrk_measure WRK_ARGS...: one wrk run against the running server, between
# snapshots of the server's and Redis's CPU time and of the EVALSHA count.
# Sets req secs rps non p50 p99 sock_err, and per request cpu_us redis_us
# (CPU µs of the server and of Redis) and evalsha_per (both 0 when no
# redis-server was started: $redis_pid empty).
wrk_measure() {
  local c0 r0=0 e0=0 c1 r1=0 e1=0
  [[ -z "$redis_pid" ]] || e0=$(evalsha_calls)
  c0=$(cpu_ticks "$server_pid"); [[ -z "$redis_pid" ]] || r0=$(cpu_ticks "$redis_pid")
  wrk "$@" >"$work/wrk.out" 2>&1
  c1=$(cpu_ticks "$server_pid"); [[ -z "$redis_pid" ]] || r1=$(cpu_ticks "$redis_pid")
  [[ -z "$redis_pid" ]] || e1=$(evalsha_calls)
  read -r req secs non p50 p99 sock_err < <(wrk_parse "$work/wrk.out")
  if [[ "$req" -eq 0 ]]; then
    echo "wrk $* made no requests:" >&2
    cat "$work/wrk.out" >&2
    exit 1
  fi
  read -r rps cpu_us redis_us evalsha_per < <(awk -v req="$req" -v secs="$secs" -v hz="$hz" \
    -v cs=$((c1 - c0)) -v rs=$((r1 - r0)) -v ev=$((e1 - e0)) \
    'BEGIN { printf "%.1f %.2f %.2f %.4f\n", req / secs, cs * 1e6 / hz / req, rs * 1e6 / hz / req, ev / req }')
}

# The facts every report starts with, as key=value lines: the machine, the
# load average at the start (`$load_start`, read by the caller) and now,
# the seconds since `$t_start`, tool versions and `$commit`.
run_facts() {
  echo "nproc=$(nproc)"
  echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  echo "load_start=$load_start"
  echo "load_end=$(cut -d' ' -f1-3 /proc/loadavg)"
  echo "elapsed=$(($(date +%s) - t_start))"
  echo "redis=$(redis-server --version 2>/dev/null | awk '{print $3}')"
  echo "wrk=$(wrk --version 2>&1 | head -n1 | awk '{print $2}')"
  echo "commit=$commit"
}
