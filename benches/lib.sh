# Shared by benches/load.sh, benches/scale.sh and benches/callgrind.sh:
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
