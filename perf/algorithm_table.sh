#!/usr/bin/env bash
# Measures every algorithm on a real Redis and prints the markdown table of
# docs/algorithms.md (on stdout; progress on stderr).
#
#   perf/algorithm_table.sh                # from anywhere in the repo
#   perf/algorithm_table.sh > table.md
#
# Starts its own redis-server on a free loopback port (never 6379), with no
# persistence, runs `cargo run --release -p tiered-ratelimit-perf --bin algorithm_table` against
# it, and stops it on exit, whatever happens. Exits non-zero if Redis does not
# start or the example fails. Needs redis-server and redis-cli (Debian package
# redis-server); python3 picks the free port when present (else bash /dev/tcp).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v redis-server >/dev/null 2>&1 || {
  echo "redis-server not found on PATH (Debian/Ubuntu: apt-get install redis-server)" >&2
  exit 1
}

# A free port: ask the kernel for one (bind to port 0), never 6379.
free_port() {
  if command -v python3 >/dev/null 2>&1; then
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
  else
    local p
    while :; do
      p=$((20000 + RANDOM % 40000))
      (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
  fi
}

workdir=$(mktemp -d "${TMPDIR:-/tmp}/algorithm_table.XXXXXX")
redis_pid=""
cleanup() {
  if [[ -n "$redis_pid" ]] && kill -0 "$redis_pid" 2>/dev/null; then
    kill "$redis_pid" 2>/dev/null || true
    wait "$redis_pid" 2>/dev/null || true
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=""
for _ in 1 2 3 4 5; do
  port=$(free_port)
  [[ "$port" == 6379 ]] && continue
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --dir "$workdir" --logfile "$workdir/redis.log" &
  redis_pid=$!
  for _ in $(seq 1 100); do
    if ! kill -0 "$redis_pid" 2>/dev/null; then break; fi # port taken meanwhile: retry
    if redis-cli -p "$port" PING 2>/dev/null | grep -q PONG; then started=1; break; fi
    sleep 0.05
  done
  [[ -n "$started" ]] && break
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=""
done
if [[ -z "$started" ]]; then
  echo "could not start redis-server on a free port" >&2
  cat "$workdir/redis.log" >&2 2>/dev/null || true
  exit 1
fi

cores=$(nproc 2>/dev/null || echo "?")
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }

# Build first, so the compiler is not competing with the measurement.
cargo build --quiet --release -p tiered-ratelimit-perf --bin algorithm_table

echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -sm), ${cores} cores${cpu:+ ($cpu)}," \
  "$(redis-server --version | cut -d' ' -f1-3), redis-server on 127.0.0.1:$port, by perf/algorithm_table.sh;" \
  "load average at start: $(load)."
echo

REDIS_URL="redis://127.0.0.1:$port/" cargo run --quiet --release -p tiered-ratelimit-perf --bin algorithm_table

echo
echo "Load average at the end: $(load) (timings are wall-clock µs in Redis: other work on the machine inflates them)."
