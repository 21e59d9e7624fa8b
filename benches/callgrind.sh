#!/usr/bin/env bash
# Instructions per request of examples/bench_server.rs under callgrind: a
# repeatable measure of what the layer adds (docs/performance.md), unlike
# wall-clock numbers on a shared machine.
#
#   benches/callgrind.sh                       # N=5000 requests per mode
#   N=20000 MODES="bare mem4" benches/callgrind.sh
#   KEEP=1 benches/callgrind.sh                # keep the callgrind.out files
#
# Builds bench_server in release with line tables (its own target
# directory, `$CARGO_TARGET_DIR/prof`), starts a throwaway redis-server
# on a free loopback port (never 6379), and for each mode runs the server
# under `valgrind --tool=callgrind`: 300 warm-up requests, counters zeroed
# (callgrind_control -z), exactly N requests over one connection (wrk -c1
# with a Lua script that stops after N responses), dump (callgrind_control
# -d). Prints instructions (Ir) per request per mode, the difference from
# `bare`, and for every mode but bare the functions with the largest
# inclusive cost. Needs valgrind, wrk, redis-server, redis-cli, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-5000}
MODES=${MODES:-"bare mem1 mem4 redis1 redis4 minimal"}
TOP=${TOP:-45}

for tool in valgrind callgrind_control callgrind_annotate wrk redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found on PATH" >&2; exit 1; }
done

target="${CARGO_TARGET_DIR:-target}/prof"
echo "[callgrind] building bench_server (release, line tables) in $target..." >&2
CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  cargo build --quiet --release --example bench_server
bin="$target/release/examples/bench_server"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
work=$(mktemp -d "${TMPDIR:-/tmp}/callgrind-bench.XXXXXX")
redis_pid=""
server_pid=""
stop() {
  if [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; then
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
  fi
}
cleanup() {
  stop "$server_pid"
  stop "$redis_pid"
  if [[ -n "${KEEP:-}" ]]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rport=$(free_port)
[[ "$rport" == 6379 ]] && rport=$(free_port)
redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --dir "$work" --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 1 100); do
  redis-cli -p "$rport" PING 2>/dev/null | grep -q PONG && break
  sleep 0.05
done
export REDIS_URL="redis://127.0.0.1:$rport/"

cat >"$work/count.lua" <<'LUA'
local n, limit = 0, tonumber(os.getenv("COUNT"))
function response()
  n = n + 1
  if n >= limit then wrk.thread:stop() end
end
LUA
requests() { # count port
  COUNT=$1 wrk -t1 -c1 -d600s -s "$work/count.lua" -H 'x-user: alice' \
    "http://127.0.0.1:$2/" >"$work/wrk.out" 2>&1
}

: >"$work/totals"
for mode in $MODES; do
  port=$(free_port)
  LISTEN_ADDR="127.0.0.1:$port" valgrind --tool=callgrind --dump-instr=no \
    --callgrind-out-file="$work/cg.$mode" "$bin" "$mode" \
    >"$work/server.out" 2>"$work/valgrind.$mode.log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/valgrind.$mode.log" >&2; exit 1; }
    sleep 0.1
  done
  requests 300 "$port"
  callgrind_control -z "$server_pid" >/dev/null
  requests "$N" "$port"
  done_n=$(awk '/ requests in / {print $1}' "$work/wrk.out")
  callgrind_control -d "$server_pid" >/dev/null
  stop "$server_pid"
  server_pid=""
  dump=$(ls -t "$work"/cg."$mode".* 2>/dev/null | head -n1)
  ir=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
  echo "$mode $done_n $ir $dump" >>"$work/totals"
  echo "[callgrind] $mode: $done_n requests, $ir Ir" >&2
done

python3 - "$work/totals" <<'EOF'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
per = {m: int(ir) / int(n) for m, n, ir, _ in rows}
print("| mode | requests | Ir per request | Ir per request − bare |")
print("|---|---|---|---|")
for m, n, ir, _ in rows:
    d = f"{per[m] - per['bare']:+,.0f}" if "bare" in per else "n/a"
    print(f"| {m} | {n} | {per[m]:,.0f} | {d} |")
EOF

while read -r mode n _ dump; do
  [[ "$mode" == bare ]] && continue
  echo
  echo "### $mode: largest inclusive costs (Ir over $n requests)"
  echo
  echo '```'
  callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null |
    sed -n '/^Ir/,$p' | grep -v '^-' | head -n "$TOP" | cut -c1-200
  echo '```'
done <"$work/totals"
