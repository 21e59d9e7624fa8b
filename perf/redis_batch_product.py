#!/usr/bin/env python3
"""Redis command time per request of the product's own check and group
commit calls, alone on one Redis (no service beside it to take its CPU):
trl_check (one request a call) against trl_batch (B requests a call), the
Envoy service's fixed-window spec (limit 10^9 an hour, the short reply),
1 or 4 keys a request, keys spread over 1000 values (perf/README.md,
"Group commit").

    bench_server library-lua > lib.lua     # perf/src/bin/bench_server.rs
    redis_batch_product.py PORT lib.lua    # FUNCTION FLUSH + LOAD on PORT

Per shape: FLUSHALL, CONFIG RESETSTAT, 12 000 requests pipelined 50 calls a
write, then usec of cmdstat_fcall / requests. Only the standard library."""
import re
import socket
import sys

port = int(sys.argv[1])
lib = open(sys.argv[2]).read()
v = re.search(r"name=tiered_ratelimit_(\w+)", lib).group(1)


def enc(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


s = socket.create_connection(("127.0.0.1", port))
f = s.makefile("rb")


def read():
    line = f.readline()
    t = line[:1]
    if t in (b"+", b"-", b":"):
        return line
    if t == b"$":
        n = int(line[1:])
        return None if n < 0 else f.read(n + 2)
    if t == b"*":
        return [read() for _ in range(max(int(line[1:]), 0))]
    raise SystemExit(f"unexpected reply {line!r}")


def cmd(*a):
    s.sendall(enc(a))
    return read()


cmd("FUNCTION", "FLUSH")
cmd("FUNCTION", "LOAD", lib)
spec = "1 1000000000 3600000000 0 0 1 8"
print("| keys a request | requests a call | command µs per request | per call |")
print("|---:|---:|---:|---:|")
for keys in (1, 4):
    for b in (1, 4, 6, 16):
        cmd("FLUSHALL")
        cmd("CONFIG", "RESETSTAT")
        n = 12000 // b
        calls = []
        for i in range(n):
            if b == 1:
                ks = ["rls-bench:d%d:10.0.%d" % (d, (i * 7 + d) % 1000) for d in range(keys)]
                calls.append(enc(["FCALL", "trl_check_" + v, keys] + ks + [""] + [spec] * keys))
                continue
            ks, argv = [], ["", "0"]
            for r in range(b):
                ks += ["rls-bench:d%d:10.0.%d" % (d, (i * b + r) % 1000) for d in range(keys)]
                argv += [keys, 0] + [spec] * keys
            calls.append(enc(["FCALL", "trl_batch_" + v, len(ks)] + ks + argv))
        for j in range(0, n, 50):
            s.sendall(b"".join(calls[j:j + 50]))
            for _ in calls[j:j + 50]:
                r = read()
                if isinstance(r, bytes) and r.startswith(b"-"):
                    raise SystemExit(f"error reply {r!r}")
        info = cmd("INFO", "commandstats").decode()
        c, u = map(int, re.search(r"cmdstat_fcall:calls=(\d+),usec=(\d+)", info).groups())
        print(f"| {keys} | {b} | {u / (c * b):.2f} | {u / c:.2f} |")
