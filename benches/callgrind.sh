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
# under `valgrind --tool=callgrind` twice: for 300 requests and for 300 + N
# (over one connection: wrk -c1 with a Lua script that stops after that many
# responses), the server then stopped with SIGTERM (callgrind writes its
# profile). The difference of the two totals is N requests' instructions,
# without startup and warm-up. Prints instructions (Ir) per request per
# mode, the difference from `bare`, and for every mode but bare the
# functions with the largest inclusive cost (of the 300 + N run). Needs valgrind, wrk, redis-server, redis-cli, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-5000}
MODES=${MODES:-"bare mem1 mem4 redis1 redis4 minimal"}
TOP=${TOP:-45}

for tool in valgrind callgrind_annotate wrk redis-server redis-cli python3; do
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
# Ir of a server that answered `count` requests, startup and exit included
# (valgrind writes the profile when the server dies of SIGTERM).
profile() { # mode count out
  local port
  port=$(free_port)
  LISTEN_ADDR="127.0.0.1:$port" valgrind --tool=callgrind --dump-instr=no \
    --callgrind-out-file="$3" "$bin" "$1" \
    >"$work/server.out" 2>"$work/valgrind.$1.log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/valgrind.$1.log" >&2; exit 1; }
    sleep 0.1
  done
  requests "$2" "$port"
  awk '/ requests in / {print $1}' "$work/wrk.out" >"$3.n"
  stop "$server_pid"
  server_pid=""
}
for mode in $MODES; do
  # Two runs, WARM and WARM + N requests: the difference is N requests'
  # worth, without startup, warm-up (first connection, script load) or exit.
  profile "$mode" 300 "$work/cg.$mode.warm"
  profile "$mode" $((300 + N)) "$work/cg.$mode"
  ir0=$(awk '/^(summary|totals):/ {print $2; exit}' "$work/cg.$mode.warm")
  ir1=$(awk '/^(summary|totals):/ {print $2; exit}' "$work/cg.$mode")
  n=$(($(cat "$work/cg.$mode.n") - $(cat "$work/cg.$mode.warm.n")))
  echo "$mode $n $((ir1 - ir0)) $work/cg.$mode" >>"$work/totals"
  echo "[callgrind] $mode: $n requests, $((ir1 - ir0)) Ir" >&2
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
  echo "### $mode: largest inclusive costs (Ir, 300 + $n requests, startup included)"
  echo
  echo '```'
  callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null |
    sed -n '/^Ir/,$p' | grep -v '^-' | head -n "$TOP" | cut -c1-200
  echo '```'
done <"$work/totals"
