#!/usr/bin/env bash
# Redis CPU per check: the layer's check against the GCRA floor, same run.
#
#   perf/redis_cpu.sh      # ~2 min; ROUNDS (3), N (100000 calls a run)
#
# Runs `redis-benchmark -P 1 -n $N` (50 clients) against a redis-server of
# its own and reads `usec_per_call` from `INFO commandstats` (reset before
# every run) for, in alternating order each round:
#   floor        the four-key minimal limiter's script (`bench_server
#                minimal4-lua`): Redis TIME, one MGET, a GCRA check per key,
#                one SET … PX per key when all allow, one integer per key,
#                answering 0 or 1. The floor of any all-or-nothing limiter.
#   fcall        the layer's check as a Redis Function (FUNCTION LOAD +
#                FCALL, what a single Redis >= 7 runs), compact format
#   evalsha      the same code as a script (EVALSHA: Redis 6, a cluster)
#   base         with BASE_BIN=<a bench_server built before a change>: that
#                build's check as a Function (its library loads beside
#                this one's: libraries are versioned by their code), so a
#                change is measured before and after in the same run
# with 1 and 4 token-bucket tiers (keys rl:global:all, rl:ip:127.0.0.1,
# rl:user:alice, rl:endpoint:GET%20/), a quota that never denies (10^9
# burst, 1000/s: every call writes). Prints a markdown table of the median
# µs per call and the ratios to the floor of the same round.
#
# BENCH_BIN (perf/lib.sh) measures a prebuilt bench_server instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
ROUNDS=${ROUNDS:-3}
N=${N:-100000}
for tool in redis-server redis-cli redis-benchmark python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
bench_setup redis_cpu
t_start=$(date +%s)
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
build_bench_server
start_redis

floor=$(rcli SCRIPT LOAD "$("$bin" minimal4-lua)")
ours=$(rcli SCRIPT LOAD "$("$bin" check-lua)")
"$bin" library-lua | rcli -x FUNCTION LOAD REPLACE >/dev/null
fn=$("$bin" function-name)
labels="floor fcall evalsha"
if [[ -n "${BASE_BIN:-}" ]]; then
  "$BASE_BIN" library-lua | rcli -x FUNCTION LOAD REPLACE >/dev/null
  base_fn=$("$BASE_BIN" function-name)
  labels="$labels base"
fi

# Per tier: "<algorithm> <capacity> <rate> <unit> <p4> <cost> <flags>" =
# token bucket, 10^12 units, 1 unit/µs, 1000 units a token, compact (+4),
# short reply (+8; what the layer sends a bucket; a build before the flag
# ignores it).
spec="4 1000000000000 1 1000 0 1 12"
keys=(rl:global:all rl:ip:127.0.0.1 rl:user:alice rl:endpoint:GET%20/)
# The floor's ARGV per key: emission interval and tolerance, µs.
fl=(1000 1000000000000)

results="$work/results.tsv"
run() { # label tiers command...
  local label=$1 tiers=$2 usec fails
  shift 2
  rcli FLUSHALL >/dev/null
  rcli CONFIG RESETSTAT >/dev/null
  redis-benchmark -p "$rport" -P 1 -n "$N" -q "$@" >/dev/null 2>&1
  read -r usec fails < <(rcli INFO commandstats | tr -d '\r' |
    awk -F'[:=,]' '/^cmdstat_(evalsha|fcall):/ {print $7, $11}')
  [[ "$fails" == 0 ]] || { echo "$label: $fails failed calls" >&2; exit 1; }
  printf '%s\t%s\t%s\t%s\n' "$round" "$label" "$tiers" "$usec" >>"$results"
  log "round $round $label $tiers tier(s): $usec µs per call"
}
for round in $(seq 1 "$ROUNDS"); do
  for n in 1 4; do
    k=("${keys[@]:0:n}")
    f=() s=()
    for _ in $(seq 1 "$n"); do f+=("${fl[@]}"); s+=("$spec"); done
    run floor "$n" evalsha "$floor" "$n" "${k[@]}" "${f[@]}"
    run fcall "$n" fcall "$fn" "$n" "${k[@]}" "" "${s[@]}"
    run evalsha "$n" evalsha "$ours" "$n" "${k[@]}" "" "${s[@]}"
    if [[ -n "${BASE_BIN:-}" ]]; then
      run base "$n" fcall "$base_fn" "$n" "${k[@]}" "" "${s[@]}"
    fi
  done
done

{
  run_facts
} >"$work/facts"
python3 - "$results" "$work/facts" "$labels" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
facts = dict(l.strip().split("=", 1) for l in open(sys.argv[2]) if "=" in l)
us = {}
for rnd, label, tiers, u in rows:
    us.setdefault((label, tiers), {})[rnd] = float(u)
print(f"Redis {facts.get('redis')}, {facts.get('cpu')}, load {facts.get('load_start')} -> "
      f"{facts.get('load_end')}, code {facts.get('commit')}\n")
print("| script | tiers | Redis µs per call (median; rounds) | × floor, same round (median; rounds) |")
print("|---|---|---|---|")
for tiers in ("1", "4"):
    base = us[("floor", tiers)]
    for label in sys.argv[3].split():
        v = us[(label, tiers)]
        ratios = [v[r] / base[r] for r in sorted(v)]
        vs = ", ".join(f"{v[r]:.2f}" for r in sorted(v))
        rs = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"| {label} | {tiers} | {statistics.median(v.values()):.2f} ({vs}) | "
              f"{statistics.median(ratios):.2f} ({rs}) |")
PY
