#!/usr/bin/env bash
# Group commit, an experiment for issue 43: would coalescing the checks of
# concurrent requests into one script call bring the Envoy service's
# fixed-window call within the issue's targets against envoyproxy/
# ratelimit's pattern (Redis command time per request <= 2x, Redis
# main-thread CPU per request, I/O included, <= 1.0x)? 16 concurrent
# clients, keys of their own, 1 and 4 descriptors, limits never reached,
# perf/redis_batch.py sending:
#   reference  16 connections, per request INCRBY + EXPIRE per descriptor
#              pipelined in one write (the reference service's pattern)
#   floor      16 connections, per request one EVALSHA of
#              perf/floors/fixed_window.lua (all or nothing; the floor of
#              any per-request script)
#   batchB     16/B connections, per call one EVALSHA of
#              perf/floors/fixed_window_batch.lua carrying B requests (each
#              all or nothing on its own keys, one TIME per call): what a
#              group commit sends when B requests arrived while the
#              connection's previous call was in flight
#   leanB      the same decisions, per-key costs cut
#              (perf/floors/fixed_window_batch_lean.lua: one MGET a call,
#              rules sent once, INCRBY on a key already in the window)
#   incrB      no read (perf/floors/fixed_window_batch_incr.lua: INCRBY per
#              key first, SET ... PXAT on a window's first request, DECRBY
#              to undo a denied request)
#
#   perf/group_commit.sh        # ~4 min; needs valgrind, redis-server 7, python3
#   BATCHES="1 4 16" VARIANTS="batch lean incr" KEYN="1 4" N1=800 N2=3200
#   N_US=32000 ROUNDS=3 (the defaults)
#
# Instructions (exact, up to the event loop's batching): redis-server under
# callgrind at --hz 1, N1 and N2 requests, (total2 - total1) / (N2 - N1).
# µs: one plain redis-server for every shape, per shape and round FLUSHALL,
# CONFIG RESETSTAT, N_US requests; command µs = usec of cmdstat_evalsha
# (incrby + expire) per request, CPU µs = used_cpu_user_main_thread +
# used_cpu_sys_main_thread gained per request (I/O included); medians of
# ROUNDS rounds, shapes alternating, ratios to the same round's reference.
# SKIP_CG=1: µs only.
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
for tool in valgrind callgrind_annotate redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
BATCHES=${BATCHES:-"1 4 16"}
VARIANTS=${VARIANTS:-"batch lean incr"}
KEYN=${KEYN:-"1 4"}
N1=${N1:-800}
N2=${N2:-3200}
N_US=${N_US:-32000}
ROUNDS=${ROUNDS:-3}
bench_setup group_commit
send=perf/redis_batch.py
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- perf/floors perf/redis_batch.py 2>/dev/null || echo '+dirty')"

shapes=(reference floor)
for v in $VARIANTS; do
  for b in $BATCHES; do shapes+=("$v$b"); done
done

wait_redis() { # PORT
  local _
  for _ in $(seq 1 300); do
    redis-cli -p "$1" PING 2>/dev/null | grep -q PONG && return 0
    sleep 0.1
  done
  echo "redis-server on $1 did not start" >&2; exit 1
}

count() { # SHAPE KEYN N -> total instructions of a redis-server that answered N requests
  local port vp out=$work/cg.$1.$2.$3
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --hz 1 \
    --dir "$work" >/dev/null 2>&1 &
  vp=$!
  wait_redis "$port"
  if ! python3 "$send" "$port" "$3" "$1" "$2"; then
    echo "$1 $2: failed" >&2
    stop "$vp"
    exit 1
  fi
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  callgrind_annotate "$out" 2>/dev/null |
    awk '/PROGRAM TOTALS/ && !done {gsub(",", "", $1); print $1; done = 1}'
}

declare -A ir us cpu
if [[ -z "${SKIP_CG:-}" ]]; then
  for k in $KEYN; do
    for s in "${shapes[@]}"; do
      a=$(count "$s" "$k" "$N1")
      b=$(count "$s" "$k" "$N2")
      ir[$s $k]=$(( (b - a) / (N2 - N1) ))
      log "$s, $k descriptors: ${ir[$s $k]} instructions per request"
    done
  done
fi

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
start_redis
for round in $(seq 1 "$ROUNDS"); do
  for k in $KEYN; do
    for s in "${shapes[@]}"; do
      read -r _ u c < <(python3 "$send" "$rport" "$N_US" "$s" "$k" --stats) ||
        { echo "$s $k: failed" >&2; exit 1; }
      us[$s $k]="${us[$s $k]:-} $u"
      cpu[$s $k]="${cpu[$s $k]:-} $c"
    done
  done
  log "round $round done"
done

echo "Redis $(redis-server --version | awk '{print $3}'), code $commit, $(nproc) CPUs, load $load_start -> $(cut -d' ' -f1-3 /proc/loadavg)"
echo "16 concurrent clients; instructions: N = $N1 and $N2; µs: median of $ROUNDS rounds of $N_US requests"
echo
echo "| descriptors | shape | requests a call | Redis instructions per request | × ref | command µs per request | × ref | main-thread CPU µs per request | × ref |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
for k in $KEYN; do
  for s in "${shapes[@]}"; do
    echo "$k $s ${ir[$s $k]:-0} ${ir[reference $k]:-0};${us[$s $k]};${us[reference $k]};${cpu[$s $k]};${cpu[reference $k]}"
  done
done | python3 -c '
import statistics, sys
for line in sys.stdin:
    head, u, ru, c, rc = line.split(";")
    k, s, i, ri = head.split()
    u, ru, c, rc = ([float(x) for x in f.split()] for f in (u, ru, c, rc))
    i, ri = int(i), int(ri)
    per = s.lstrip("abcdefghijklmnopqrstuvwxyz") or "1"
    med = statistics.median
    irs = f"{i:,}" if i else "–"
    irr = f"{i / ri:.2f}" if i and ri else "–"
    print(f"| {k} | {s} | {per} | {irs} | {irr} | {med(u):.2f} | {med([a / b for a, b in zip(u, ru)]):.2f} "
          f"| {med(c):.2f} | {med([a / b for a, b in zip(c, rc)]):.2f} |")
'
