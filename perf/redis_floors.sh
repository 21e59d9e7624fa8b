#!/usr/bin/env bash
# Redis's cost per check against a floor per algorithm (issue 43): for each
# algorithm and 1 and 4 keys, Redis instructions per call (callgrind,
# exact) and Redis µs per call (INFO commandstats) of
#   floor      perf/floors/<algorithm>.lua by EVALSHA: a minimal
#              all-or-nothing script doing only what the algorithm needs
#              (Redis TIME, one MGET, one SET ... PX per key; the log: a
#              sorted set per key)
#   layer      the call RedisBackend sends by default (captured with
#              MONITOR from bench_server redis1/redis4): FCALL, the tier keys,
#              the hour's set of refused keys (the shadow-limited set only
#              comes with a shadow tier), the deadline clock argument, one
#              spec per tier (short: buckets, fixed and calendar windows, logs)
#   envoy      the Envoy service's call for the same rule (captured from
#              tiered-ratelimit-rls on the reference's YAML): the same
#              FCALL with the service's key names
#   reference  fixed windows only: envoyproxy/ratelimit's pattern, INCRBY +
#              EXPIRE per descriptor, pipelined in one write per request
#
#   perf/redis_floors.sh                  # ~15 min; needs valgrind, python3
#   ALGOS="fixed_window" KEYN="1" perf/redis_floors.sh
#
# Instructions: redis-server under `valgrind --tool=callgrind`, the library
# (FUNCTION LOAD) and every floor (SCRIPT LOAD) loaded, `--hz 1` (its
# timer's work grows with the wall time, which callgrind stretches ~50
# times: at the default 10 Hz it moved counts by ±2 %), one client
# (perf/redis_send.py) sending one call shape N1 and N2 times, each call
# after the previous reply; the figure is the difference of the two totals
# / (N2 - N1), so start-up and loads cancel out. µs: one plain
# redis-server, per shape FLUSHALL, CONFIG RESETSTAT, N_US calls, then
# usec of cmdstat_fcall / cmdstat_evalsha (the reference: INCRBY + EXPIRE)
# per request; the median of ROUNDS rounds, shapes alternating in each.
# Limits are never reached: windows 50 000 an hour (the calendar: a day),
# buckets a burst of 10^9 refilled at 1000/s, the log 10^9 a LOG_WINDOW_US
# window (default 1 000 µs, so the log stays a few entries long; under
# callgrind ~1, at full speed ~50).
#
# Knobs: ALGOS, KEYN ("1 4"), N1 (1000), N2 (5000), N_US (20000), ROUNDS
# (3), BENCH_BIN (a prebuilt bench_server, which prints the library),
# SKIP_CG=1 (µs only), SKIP_US=1 (instructions only), LIBRARY (a file
# holding the library to load instead of the bench_server's: to try an
# edit of lua/ without a build; keep its registered functions' names).
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
for tool in valgrind callgrind_annotate redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
ALGOS=${ALGOS:-"fixed_window sliding_window_counter sliding_window_log token_bucket leaky_bucket calendar"}
KEYN=${KEYN:-"1 4"}
N1=${N1:-1000}
N2=${N2:-5000}
N_US=${N_US:-20000}
ROUNDS=${ROUNDS:-3}
LOG_WINDOW_US=${LOG_WINDOW_US:-1000}
bench_setup redis_floors
if [[ -n "${BENCH_BIN:-}" ]]; then
  bin=$BENCH_BIN
  commit=${BENCH_COMMIT:-prebuilt}
else
  commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src lua perf/floors 2>/dev/null || echo '+dirty')"
  log "building bench_server (it prints the library; its profile does not matter)..."
  cargo build --quiet -p tiered-ratelimit-perf --bin bench_server
  bin="${CARGO_TARGET_DIR:-target}/debug/bench_server"
fi
if [[ -n "${LIBRARY:-}" ]]; then
  cp "$LIBRARY" "$work/library.lua" # an edited library (its function's name kept)
else
  "$bin" library-lua >"$work/library.lua"
fi
fn=$("$bin" function-name)
send=perf/redis_send.py

# The call shapes: shape NAME -> the words of one request for redis_send.py
# (FLOOR_<algorithm> stands for that floor's SHA1).
now_s=$(date +%s)
hour=$(( now_s / 3600 ))
b0=$(( (now_s - 43200) * 1000000 )); b1=$(( (now_s + 43200) * 1000000 )); b2=$(( (now_s + 129600) * 1000000 ))
deadline="-4102444800000000" # 2100-01-01: a deadline never passed
W=3600000000
declare -A spec floor_args
spec[fixed_window]="1 50000 $W 0 0 1 8";            floor_args[fixed_window]="50000 $W"
spec[sliding_window_counter]="3 50000 $W 0 0 1 0";  floor_args[sliding_window_counter]="50000 $W 60000"
spec[sliding_window_log]="2 1000000000 $LOG_WINDOW_US 0 0 1 8"; floor_args[sliding_window_log]="1000000000 $LOG_WINDOW_US"
spec[token_bucket]="4 1000000000000 1 1000 0 1 8";  floor_args[token_bucket]="1000 1000000000000"
spec[leaky_bucket]="5 1000000000000 1 1000 -1 1 8"; floor_args[leaky_bucket]="1000 1000000000000"
spec[calendar]="9 50000 $b0 $b1 $b2 1 8";           floor_args[calendar]="50000 $b0 $b1 $b2"
layer_keys=(rl:global:all rl:ip:127.0.0.1 rl:user:alice rl:endpoint:GET%20/)
# The hour's set of refused keys (and of shadow-limited ones, with a tier
# in shadow mode: none here).
layer_sets=(rl:blocked:$hour)
rls_keys=("rls:bench:remote_address:10.0.0.1" "rls:bench:user_path:6:user1|10:/api/items"
  "rls:bench:tenant:t1" "rls:bench:generic_key_global:global")
rls_sets=(rls:bench:blocked:$hour)
ref_keys=("bench_remote_address_10.0.0.1_$now_s" "bench_user_user1_path_/api/items_$now_s"
  "bench_tenant_t1_$now_s" "bench_generic_key_global_$now_s")

shape() { # KIND ALGO N
  local kind=$1 algo=$2 n=$3 i words=()
  case $kind in
    floor)
      words=(evalsha "FLOOR_$algo" "$n" "${layer_keys[@]:0:n}")
      for ((i = 0; i < n; i++)); do words+=(${floor_args[$algo]}); done ;;
    layer|envoy)
      if [[ $kind == layer ]]; then words=(fcall "$fn" $((n + ${#layer_sets[@]})) "${layer_keys[@]:0:n}" "${layer_sets[@]}")
      else words=(fcall "$fn" $((n + ${#rls_sets[@]})) "${rls_keys[@]:0:n}" "${rls_sets[@]}"); fi
      words+=("$deadline")
      for ((i = 0; i < n; i++)); do words+=("${spec[$algo]}"); done ;;
    reference)
      for ((i = 0; i < n; i++)); do
        ((i == 0)) || words+=(";;")
        words+=(incrby "${ref_keys[i]}" 1 ";;" expire "${ref_keys[i]}" 3600)
      done ;;
  esac
  printf '%s\n' "${words[@]}"
}

load_all() { # PORT: the library and every floor; prints "algo=sha" lines
  local port=$1 a
  redis-cli -p "$port" -x FUNCTION LOAD REPLACE <"$work/library.lua" >/dev/null
  for a in fixed_window sliding_window_counter sliding_window_log token_bucket leaky_bucket calendar; do
    echo "$a=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "perf/floors/$a.lua")")"
  done
}

resolve() { # SHAS_FILE WORDS_FILE -> words with FLOOR_<algo> replaced
  python3 - "$1" "$2" <<'PY'
import sys
shas = dict(l.strip().split("=", 1) for l in open(sys.argv[1]) if "=" in l)
for w in open(sys.argv[2]).read().split("\n")[:-1]:
    print(shas.get(w[6:], w) if w.startswith("FLOOR_") else w)
PY
}

wait_redis() { # PORT
  local _
  for _ in $(seq 1 300); do
    redis-cli -p "$1" PING 2>/dev/null | grep -q PONG && return 0
    sleep 0.1
  done
  echo "redis-server on $1 did not start" >&2; exit 1
}

# count LABEL N WORDS_FILE: total instructions of a redis-server under
# callgrind that answered N requests.
count() {
  local label=$1 n=$2 words=$3 port vp
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$label.$n" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --hz 1 \
    --dir "$work" >/dev/null 2>&1 &
  vp=$!
  wait_redis "$port"
  load_all "$port" >"$work/shas"
  mapfile -t args < <(resolve "$work/shas" "$words")
  if ! python3 "$send" "$port" "$n" "${args[@]}"; then
    echo "$label: failed" >&2
    stop "$vp"
    exit 1
  fi
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  callgrind_annotate "$work/cg.$label.$n" 2>/dev/null |
    awk '/PROGRAM TOTALS/ && !done {gsub(",", "", $1); print $1; done = 1}'
}

rows=()
for algo in $ALGOS; do
  for n in $KEYN; do
    for kind in floor layer envoy reference; do
      [[ $kind == reference && $algo != fixed_window ]] && continue
      shape "$kind" "$algo" "$n" >"$work/words.$kind.$algo.$n"
      rows+=("$kind $algo $n")
    done
  done
done

declare -A ir us
if [[ -z "${SKIP_CG:-}" ]]; then
  for r in "${rows[@]}"; do
    set -- $r
    a=$(count "$1.$2.$3" "$N1" "$work/words.$1.$2.$3")
    b=$(count "$1.$2.$3" "$N2" "$work/words.$1.$2.$3")
    ir[$r]=$(( (b - a) / (N2 - N1) ))
    log "$r: ${ir[$r]} instructions per call"
  done
fi

if [[ -z "${SKIP_US:-}" ]]; then
  start_redis
  load_all "$rport" >"$work/shas"
  for r in "${rows[@]}"; do
    set -- $r
    resolve "$work/shas" "$work/words.$1.$2.$3" >"$work/args.$1.$2.$3"
  done
  for round in $(seq 1 "$ROUNDS"); do
    for r in "${rows[@]}"; do
      set -- $r
      rcli FLUSHALL >/dev/null
      rcli CONFIG RESETSTAT >/dev/null
      mapfile -t args <"$work/args.$1.$2.$3"
      python3 "$send" "$rport" "$N_US" "${args[@]}" || { echo "$r: failed" >&2; exit 1; }
      v=$(rcli INFO commandstats | tr -d '\r' | awk -F'[:=,]' -v n="$N_US" '
        /^cmdstat_(fcall|evalsha|incrby|expire):/ {u += $5}
        /failed_calls=[1-9]/ {bad = 1}
        END {if (bad) print "failed"; else printf "%.2f\n", u / n}')
      [[ $v != failed ]] || { echo "$r: failed calls" >&2; exit 1; }
      us[$r]="${us[$r]:-} $v"
    done
    log "round $round done"
  done
fi

echo "Redis $(redis-server --version | awk '{print $3}'), code $commit, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "instructions: N = $N1 and $N2; µs: median of $ROUNDS rounds of $N_US calls"
echo
echo "| algorithm | keys | call | Redis instructions per call | × floor | Redis µs per call | × floor |"
echo "|---|---:|---|---:|---:|---:|---:|"
for r in "${rows[@]}"; do
  set -- $r
  echo "$1 $2 $3 ${ir[$r]:-0} ${ir[floor $2 $3]:-0} ${us[$r]:-} ;${us[floor $2 $3]:-}"
done | python3 -c '
import statistics, sys
for line in sys.stdin:
    head, fus = line.split(";")
    kind, algo, n, ir, fir, *u = head.split()
    fu = [float(x) for x in fus.split()]
    u = [float(x) for x in u]
    ir, fir = int(ir), int(fir)
    irs = f"{ir:,}" if ir else "–"
    irr = f"{ir / fir:.2f}" if ir and fir else "–"
    us = f"{statistics.median(u):.2f}" if u else "–"
    usr = f"{statistics.median([a / b for a, b in zip(u, fu)]):.2f}" if u and fu else "–"
    print(f"| {algo} | {n} | {kind} | {irs} | {irr} | {us} | {usr} |")
'
