#!/usr/bin/env bash
# Measures `tiered-ratelimit replay` (release build, memory backend) on a
# generated combined-format access log, and prints lines per second.
#
#   perf/replay.sh                  # 5 000 000 lines
#   LINES=20000000 perf/replay.sh   # more
#   RUNS=5 perf/replay.sh           # runs per row (default 3; medians reported)
#   KEEP=1 perf/replay.sh           # keep the generated files (path printed)
#
# Runs, each on the same log: the direct engine on the plain file, on the
# gzip file, with the JSON report, on a JSON-lines version, with a one-tier
# policy instead of five, with four candidate quotas on the ip tier, and the
# layer engine (a real axum Router per
# request) on the first 500 000 lines. The
# generated log: 20 000 clients with a skewed mix (a few heavy, many
# light), one abusive IP sending ~5 % of all requests, a 60-second burst
# from 200 addresses every 20 minutes, users on ~30 % of requests, API keys
# on ~20 %, five routes plus unmatched paths; 1 000 requests per second of
# log time. Needs bash, awk, gzip; cargo builds the binary first.
set -euo pipefail
cd "$(dirname "$0")/.."

LINES=${LINES:-5000000}
RUNS=${RUNS:-3}
KEEP=${KEEP:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/replay-bench.XXXXXX")
cleanup() { [[ -n "$KEEP" ]] && echo "kept $work" >&2 || rm -rf "$work"; }
trap cleanup EXIT

echo "building (release, -p tiered-ratelimit-cli)..." >&2
cargo build --quiet --release -p tiered-ratelimit-cli --bin tiered-ratelimit
bin="${CARGO_TARGET_DIR:-target}/release/tiered-ratelimit"

cat > "$work/policy.toml" <<'EOF'
[[tier]]
name = "global"
key = "global"
limit = 2000
period = "1s"
burst = 4000

[[tier]]
name = "ip"
key = "ip"
limit = 300
period = "1m"

[[tier]]
name = "user"
key = "user"
limit = 120
period = "1m"
algorithm = "sliding_window_counter"

[[tier]]
name = "api_key"
key = { header = "x-api-key" }
limit = 1000
period = "1h"

[[tier]]
name = "endpoint"
key = "endpoint"
limit = 3000
period = "10s"
algorithm = "fixed_window"
EOF

echo "generating $LINES lines..." >&2
awk -v n="$LINES" 'BEGIN {
  srand(42);
  split("GET GET GET GET GET GET GET POST POST PUT DELETE", methods, " ");
  for (i = 0; i < n; i++) {
    t = int(i / 1000);                       # 1000 requests per second
    day = 1 + int(t / 86400); s = t % 86400;
    ts = sprintf("%02d/Mar/2024:%02d:%02d:%02d +0000", day, int(s / 3600), int(s % 3600 / 60), s % 60);
    r = rand();
    if (r < 0.05) {                          # the abusive client
      ip = "203.0.113.66";
    } else if (t % 1200 < 60 && r < 0.35) {  # a burst from a small botnet
      ip = sprintf("198.51.100.%d", 1 + int(rand() * 200));
    } else {                                 # skewed: low numbers are busier
      c = int(20000 * rand() ^ 3);
      ip = sprintf("10.%d.%d.%d", int(c / 65536), int(c / 256) % 256, c % 256);
    }
    m = methods[1 + int(rand() * 11)];
    p = rand();
    if (p < 0.40) path = sprintf("/users/%d", int(rand() * 100000));
    else if (p < 0.60) path = sprintf("/api/items/%d?page=%d", int(rand() * 5000), int(rand() * 9));
    else if (p < 0.70) { path = "/login"; m = "POST" }
    else if (p < 0.85) path = "/";
    else if (p < 0.95) path = sprintf("/static/app.%d.js", int(rand() * 50));
    else path = sprintf("/wp-login.php?x=%d", int(rand() * 1000));
    user = (rand() < 0.3) ? sprintf("u%d", int(rand() * 3000 * rand())) : "-";
    key = (rand() < 0.2) ? sprintf("sk_live_%08d", int(rand() * 500)) : "-";
    status = (rand() < 0.97) ? 200 : 404;
    printf "%s - %s [%s] \"%s %s HTTP/1.1\" %d %d \"-\" \"Mozilla/5.0 (X11; Linux x86_64) bench/1.0\" \"%s\"\n",
      ip, user, ts, m, path, status, 100 + int(rand() * 5000), key;
  }
}' > "$work/access.log"

bytes=$(stat -c %s "$work/access.log")
echo "compressing..." >&2
gzip -1 -c "$work/access.log" > "$work/access.log.gz"
echo "converting to JSON lines..." >&2
awk '{
  # ip - user [ts tz] "m path proto" status bytes "ref" "ua" "key"
  match($0, /\[[^]]*\]/); ts = substr($0, RSTART + 1, RLENGTH - 2);
  match($0, /"[^"]*"/); req = substr($0, RSTART + 1, RLENGTH - 2); split(req, q, " ");
  n = split($0, f, "\""); key = f[n - 1];
  printf "{\"time\":\"%s\",\"remote_addr\":\"%s\",\"method\":\"%s\",\"path\":\"%s\",\"status\":%s,\"user\":\"%s\",\"api_key\":\"%s\",\"ua\":\"Mozilla/5.0 bench/1.0\"}\n",
    ts, $1, q[1], q[2], $9, $3, key;
}' "$work/access.log" > "$work/access.jsonl"

cores=$(nproc 2>/dev/null || echo "?")
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)
echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -sm), ${cores} cores${cpu:+ ($cpu)}, by perf/replay.sh;"
echo "log: $LINES lines, $((bytes / 1024 / 1024)) MiB plain, $(( $(stat -c %s "$work/access.log.gz") / 1024 / 1024 )) MiB gzip; policy: 5 tiers."
echo

routes=(--route '/users/{id}' --route '/api/items/{id}' --route '/login' --route '/' --route '/static/{*path}')
common=("${routes[@]}" --extra-field header:x-api-key --no-progress)

run() {
  local label=$1 lines=$2 policy=$3; shift 3
  local out i rates=() cpus=()
  # Each run ${RUNS} times; the median CPU (user+sys, from bash's time) and
  # the median wall-clock rate (from the binary) are reported: other work
  # on a shared machine inflates single runs.
  TIMEFORMAT='%U %S'
  for ((i = 0; i < RUNS; i++)); do
    { out=$( { time "$bin" replay -p "$policy" "${common[@]}" "$@" >/dev/null; } 2>&1 ); } || { echo "$label: failed: $out" >&2; return 1; }
    rates+=("$(grep -o '[0-9]* lines/s' <<<"$out" | head -1 | cut -d' ' -f1)")
    cpus+=("$(tail -1 <<<"$out" | awk '{ printf "%.3f", $1 + $2 }')")
  done
  local rate cpu per_cpu
  rate=$(printf '%s\n' "${rates[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  cpu=$(printf '%s\n' "${cpus[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  per_cpu=$(awk -v n="$lines" -v c="$cpu" 'BEGIN { printf "%.0f", n / c }')
  printf '| %s | %s | %.2f s | %s | %s |\n' "$label" "$rate" "$cpu" "$(IFS=/; echo "${cpus[*]}")" "$per_cpu"
}

load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }
echo "Load average at start: $(load) (other work on the machine slows every run: compare CPU seconds)."
echo
echo "| run | lines/s (wall, median) | CPU (user+sys, both threads, median) | CPU of each run, s | lines per CPU second |"
echo "|---|---|---|---|---|"
p5="$work/policy.toml"
run "direct, plain file" "$LINES" "$p5" "$work/access.log"
run "direct, gzip file" "$LINES" "$p5" "$work/access.log.gz"
run "direct, plain file, --json" "$LINES" "$p5" --json "$work/access.log"
run "direct, JSON lines" "$LINES" "$p5" --format json --field header:x-api-key=api_key "$work/access.jsonl"
printf '[[tier]]\nname = "ip"\nkey = "ip"\nlimit = 300\nperiod = "1m"\n' > "$work/one-tier.toml"
run "direct, plain file, 1 tier (ip) instead of 5" "$LINES" "$work/one-tier.toml" "$work/access.log"
# The five tiers with four candidate quotas on the ip tier (issue: at
# least 0.4 M lines per CPU second with 4 candidates).
sed 's/^limit = 300$/limit = 300\ncandidates = [{ limit = 100, period = "1m" }, { limit = 150, period = "1m" }, { limit = 200, period = "1m" }, { limit = 600, period = "1m" }]/' "$p5" > "$work/candidates.toml"
run "direct, plain file, 4 candidates on the ip tier" "$LINES" "$work/candidates.toml" "$work/access.log"
head_lines=$(( LINES < 500000 ? LINES : 500000 ))
head -n "$head_lines" "$work/access.log" > "$work/head.log"
run "layer engine (axum Router), first $head_lines lines" "$head_lines" "$p5" --engine layer "$work/head.log"
echo
echo "Load average at the end: $(load)."
echo
echo "Report of the plain run:"
echo
"$bin" replay -p "$p5" "${common[@]}" -q "$work/access.log"
