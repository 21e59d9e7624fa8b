#!/usr/bin/env bash
# Instructions per request of perf/src/bin/bench_server.rs under callgrind: a
# repeatable measure of what the layer adds (perf/README.md), unlike
# wall-clock numbers on a shared machine.
#
#   perf/callgrind.sh                       # N=5000 requests per mode
#   N=20000 MODES="bare mem4" perf/callgrind.sh
#   KEEP=1 perf/callgrind.sh                # keep the callgrind.out files
#   BENCH_BIN=<path> perf/callgrind.sh      # a prebuilt bench_server
#
# Builds bench_server in release with line tables (its own target
# directory, `$CARGO_TARGET_DIR/prof`), starts a throwaway redis-server on a
# free loopback port (never 6379), and for each mode runs the server under
# `valgrind --tool=callgrind` twice: for 300 requests and for 300 + N (over
# one keep-alive connection, by curl), then stops it with SIGTERM (callgrind
# writes its profile on the way out). The difference of the two totals is N
# requests' instructions, without startup, warm-up (first connection, script
# load) or exit (for governor modes, also without its clock's calibration,
# whose length varies). Prints instructions (Ir) per request per mode, the
# difference from `bare`, and for every mode but bare the functions with the
# largest inclusive cost (of the 300 + N run). Needs valgrind, curl,
# redis-server, redis-cli, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-5000}
MODES=${MODES:-"bare mem1 mem4 governor governor_headers redis1 redis4 minimal minimal4"}
TOP=${TOP:-45}

for tool in valgrind callgrind_annotate curl redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found on PATH" >&2; exit 1; }
done

if [[ -n "${BENCH_BIN:-}" ]]; then
  # A prebuilt bench_server (say a build from before a change): the totals
  # are exact; the function table needs line tables to name lines.
  bin=$BENCH_BIN
  echo "[callgrind] running the prebuilt $bin" >&2
else
  target="${CARGO_TARGET_DIR:-target}/prof"
  echo "[callgrind] building bench_server (release, line tables) in $target..." >&2
  CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    cargo build --quiet --release -p tiered-ratelimit-perf --bin bench_server
  bin="$target/release/bench_server"
fi

source perf/lib.sh
bench_setup callgrind
start_redis

# `count` requests over one keep-alive connection (curl's URL globbing; the
# query string does not change the route or any key).
requests() { # count port
  curl -s -H 'x-user: alice' -o /dev/null -w '%{http_code}\n' \
    "http://127.0.0.1:$2/?[1-$1]" >"$work/codes" || true
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
  grep -c '^[1-5]' "$work/codes" >"$3.n" || true
  stop "$server_pid"
  server_pid=""
}
# Ir of tower_governor's startup (its clock's calibration) in a profile.
startup_ir() { # callgrind.out
  callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$1" 2>/dev/null |
    awk '/GovernorConfigBuilder<K,M>::finish/ && !/=>/ {
           n = $1; gsub(/,/, "", n); if (n + 0 > m) m = n + 0 } END {print m + 0}'
}
for mode in $MODES; do
  # Two runs, WARM and WARM + N requests: the difference is N requests'
  # worth, without startup, warm-up (first connection, script load) or exit.
  profile "$mode" 300 "$work/cg.$mode.warm"
  profile "$mode" $((300 + N)) "$work/cg.$mode"
  ir0=$(awk '/^(summary|totals):/ {print $2; exit}' "$work/cg.$mode.warm")
  ir1=$(awk '/^(summary|totals):/ {print $2; exit}' "$work/cg.$mode")
  if [[ "$mode" == governor* ]]; then
    # tower_governor's quanta clock calibrates at startup for as long as it
    # takes to settle (1-2 % of a run's Ir, different each run): take each
    # run's calibration (`GovernorConfigBuilder::finish`, inclusive) out.
    ir0=$((ir0 - $(startup_ir "$work/cg.$mode.warm")))
    ir1=$((ir1 - $(startup_ir "$work/cg.$mode")))
  fi
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

# Per request: the 300 + N run's inclusive costs ÷ its request count (the
# startup share is small at N = 5000). Runtime and hyper frames are left out:
# what remains is the layer, its dependencies and the allocator.
while read -r mode n _ dump; do
  [[ "$mode" == bare ]] && continue
  total=$(cat "$dump.n")
  echo
  echo "### $mode: largest inclusive costs, Ir per request"
  echo
  echo '```'
  { callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null || true; } |
    sed -n '/file:function/,$p' |
    sed -E 's|/root/.cargo/registry/src/[^/]+/||; s|/rustc/[0-9a-f]+/library/||; s| \[[^]]*\]$||' |
    grep -E 'tiered_ratelimit|moka|metrics|redis|arc_swap|governor|bench_server::|malloc|free|HeaderMap|HeaderValue|Instant|tokio::time::' |
    awk -v n="$total" '{ir = $1; gsub(/,/, "", ir); sub(/^ *[0-9,]+ +\([ 0-9.%]+\) +/, "");
                        printf "%8.0f  %s\n", ir / n, $0}' |
    head -n "$TOP" || true
  echo '```'
done <"$work/totals"
