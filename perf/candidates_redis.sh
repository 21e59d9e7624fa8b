#!/usr/bin/env bash
# Redis instructions per check with candidate quotas (docs/rollout.md,
# "Candidate quotas"): the call the layer sends for one token-bucket tier
# (the default: FCALL, the tier key and the hourly blocked-keys set, the
# deadline clock argument, the short-reply spec of a quota that never
# denies), alone and with 1, 2 and 4 candidates of the same algorithm
# that never deny, in the shapes a call can send them
# (src/backend/redis/wire/args.rs, `packs`, `embedded_packs` and
# `pack_key`): packed, one spec ("10 <live> <k>" then seven numbers a
# candidate: lua/dispatch.lua, `pack_spec`) carried in the live tier's own
# spec after " c ", the pack in the tier key's value, as the layer sends a
# token bucket's; the same spec as an argument of its own with the tier
# key again as its key (as the layer sends a pack its tier key holds that
# is not at the end of the call); with ONE key `<tier key>{c}`, as it
# sends them beside a sliding log; and each on its own key
# `<tier key>{c:<quota>}` with its own spec (flag +16 naming the live
# check), as it sends a sliding log's candidate of another algorithm.
# Counted by callgrind as perf/redis_instructions.sh counts them (the
# difference of N = 2 000 and N = 12 000 calls / 10 000). Prints a
# markdown table with the ratio to the tier without candidates.
#
#   perf/candidates_redis.sh     # ~6 min; needs valgrind, redis-benchmark
#   BENCH_BIN=<path> perf/candidates_redis.sh   # a prebuilt bench_server
set -euo pipefail
cd "$(dirname "$0")/.."
. perf/lib.sh
for tool in valgrind callgrind_annotate redis-server redis-cli redis-benchmark python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
bench_setup candidates_redis
build_bench_server
spec="4 1000000000000 1 1000 0 1 8"
# +8 short, +16 candidate, + 32 × 1 (the live check is the first).
cand() { echo "4 $((1000000000000 + $1)) 1 1000 0 1 56"; }
deadline="-99999999999999999"
key=rl:ip:127.0.0.1

count() { # LABEL N ARGS...
  local label=$1 n=$2 port vp fn _
  shift 2
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$label.$n" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" >/dev/null 2>&1 &
  vp=$!
  for _ in $(seq 1 200); do
    redis-cli -p "$port" PING 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  "$bin" library-lua | redis-cli -p "$port" -x FUNCTION LOAD REPLACE >/dev/null
  fn=$("$bin" function-name)
  local args=("$@")
  args=("${args[@]/FN/$fn}")
  redis-benchmark -p "$port" -c 1 -P 1 -n "$n" -q "${args[@]}" >/dev/null 2>&1
  redis-cli -p "$port" INFO commandstats | grep -q 'failed_calls=0' ||
    { echo "$label: failed calls" >&2; exit 1; }
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  callgrind_annotate "$work/cg.$label.$n" 2>/dev/null |
    awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}'
}

per_call() { # LABEL ARGS...
  local label=$1 a b
  shift
  a=$(count "$label" 2000 "$@")
  b=$(count "$label" 12000 "$@")
  echo $(( (b - a) / 10000 ))
  log "$label: $(( (b - a) / 10000 )) instructions per call"
}

# A candidate's tag in its pack: FNV-1a of its key past the tier key,
# below 2^52 (wire::pack_tag).
tag() {
  python3 -c 'import sys
h = 0xcbf29ce484222325
for b in sys.argv[1].encode():
    h = ((h ^ b) * 0x100000001b3) % 2**64
print(h % 2**52)' "$1"
}

own() { # K: the call with K candidates, each on its own key
  local k=$1 keys=("$key") specs=("$spec") j
  for j in $(seq 1 "$k"); do
    keys+=("$key{c:$j}")
    specs+=("$(cand "$j")")
  done
  per_call "own$k" fcall FN $((k + 2)) "${keys[@]}" rl:blocked:h "$deadline" "${specs[@]}"
}

packed() { # K WHERE: the call with K candidates packed: in the tier key's
  # own value with their spec in the tier's (WHERE = embedded, as the
  # layer sends them) or as an argument of its own with the tier key as
  # its key (WHERE = inline), or in one key of their own (WHERE = apart:
  # `<tier key>{c}`, as a sliding log's)
  local k=$1 pack="10 1 $1" j pkey=$key
  [[ $2 == apart ]] && pkey="$key{c}"
  for j in $(seq 1 "$k"); do
    pack+=" 4 $((1000000000000 + j)) 1 1000 0 1 $(tag "{c:$j}")"
  done
  if [[ $2 == embedded ]]; then
    per_call "packed$k$2" fcall FN 2 "$key" rl:blocked:h "$deadline" "$spec c $pack"
  else
    per_call "packed$k$2" fcall FN 3 "$key" "$pkey" rl:blocked:h "$deadline" "$spec" "$pack"
  fi
}

# The same with a bucket whose key lives (4 × 10^15 µs of capacity, each
# call costing 10^9: the key is found and its states read every call,
# where the shape above finds it gone, its PX being 1 ms).
lived() { # K
  local k=$1 long="4 4000000000000000 1 1000000000 0 1 8" pack="10 1 $1" j
  if [[ $k == 0 ]]; then
    per_call "lived0" fcall FN 2 "$key" rl:blocked:h "$deadline" "$long"
    return
  fi
  for j in $(seq 1 "$k"); do
    pack+=" 4 $((4000000000000000 + j)) 1 1000000000 0 1 $(tag "{c:$j}")"
  done
  per_call "lived$k" fcall FN 2 "$key" rl:blocked:h "$deadline" "$long c $pack"
}

c0=$(own 0)
p1=$(packed 1 embedded)
p2=$(packed 2 embedded)
p4=$(packed 4 embedded)
i4=$(packed 4 inline)
c0b=$(own 0)
a1=$(packed 1 apart)
a4=$(packed 4 apart)
o1=$(own 1)
o2=$(own 2)
o4=$(own 4)
l0=$(lived 0)
l4=$(lived 4)
echo "Redis $(redis-server --version | awk '{print $3}'), code $commit"
echo
echo "| call | Redis instructions per call | × without |"
echo "|---|---|---|"
# The tier alone is measured twice, before and after the packs in the
# tier key; the ratios are to the mean of the two.
python3 - "$c0" "$c0b" "$p1" "$p2" "$p4" "$i4" "$a1" "$a4" "$o1" "$o2" "$o4" <<'PY'
import sys
c = list(map(int, sys.argv[1:]))
base = (c[0] + c[1]) / 2
names = ("1 tier", "1 tier (again)",
         "1 tier + 1 candidate, packed in the tier key", "1 tier + 2 candidates, packed in the tier key",
         "1 tier + 4 candidates, packed in the tier key",
         "1 tier + 4 candidates, packed in the tier key, their spec on its own",
         "1 tier + 1 candidate, packed in `{c}`", "1 tier + 4 candidates, packed in `{c}`",
         "1 tier + 1 candidate, own key", "1 tier + 2 candidates, own keys", "1 tier + 4 candidates, own keys")
for name, v in zip(names, c):
    print(f"| {name} | {v:,} | {v / base:.3f} |")
PY
echo
echo "| a key that lives | Redis instructions per call | × without |"
echo "|---|---|---|"
python3 -c 'import sys
a, b = map(int, sys.argv[1:])
print(f"| 1 tier | {a:,} | 1.000 |")
print(f"| 1 tier + 4 candidates, packed in the tier key | {b:,} | {b / a:.3f} |")' "$l0" "$l4"
