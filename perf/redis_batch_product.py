#!/usr/bin/env python3
"""Redis command time per request of the product's own check and group
commit calls, alone on one Redis (no service beside it to take its CPU):
trl_check (one request a call) against trl_batch (B requests a call), and
the reference's INCRBY + EXPIRE per key in the same run, the
Envoy service's fixed-window spec (limit 10^9 an hour, the short reply),
1 or 4 keys a request, keys spread over 1000 values (perf/README.md,
"Group commit").

    bench_server library-lua > lib.lua     # perf/src/bin/bench_server.rs
    redis_batch_product.py PORT lib.lua    # FUNCTION FLUSH + LOAD on PORT

Per shape: FLUSHALL, CONFIG RESETSTAT, 12 000 requests pipelined 50 calls a
write, then usec of cmdstat_fcall / requests. Only the standard library.

    redis_batch_product.py PORT lib.lua --count SHAPE KEYS B N

sends N requests of one shape and prints nothing (perf/batch_instructions.sh
counts redis-server's instructions under callgrind for two N): SHAPE
product (trl_check for B = 1, else trl_batch with B requests a call), lab
(perf/floors/fixed_window_batch_incr.lua, B requests a call, EVALSHA) or
reference (INCRBY + EXPIRE per key), KEYS keys a request over 16 values
each, so that past the first 16 requests every key is in its window."""
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


def flat(r):
    return [x for q in r for x in flat(q)] if isinstance(r, list) else [r]


def count(shape, keys, b, n):
    here = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
    sha = None
    if shape == "lab":
        sha = cmd("SCRIPT", "LOAD", open(here + "/floors/fixed_window_batch_incr.lua").read())[:-2].decode()
    calls = []
    for i in range(n // b):
        ks = ["rls-bench:d%d:10.0.%d" % (d, (i * b + r) % 16) for r in range(b) for d in range(keys)]
        if shape == "reference":
            calls.append(b"".join(enc(c) for k in ks for c in (["INCRBY", k, 1], ["EXPIRE", k, 3600])))
        elif shape == "lab":
            calls.append(enc(["EVALSHA", sha, len(ks)] + ks + [1, 1000000000, 3600000000] + ["1" * keys] * b))
        elif b == 1:
            calls.append(enc(["FCALL", "trl_check_" + v, keys] + ks + [""] + [spec] * keys))
        else:
            argv = ["", "0"]
            for r in range(b):
                argv += [keys, 0] + [spec] * keys
            calls.append(enc(["FCALL", "trl_batch_" + v, len(ks)] + ks + argv))
    per = 2 * keys * b if shape == "reference" else 1
    for j in range(0, len(calls), 50):
        s.sendall(b"".join(calls[j:j + 50]))
        for _ in range(per * len(calls[j:j + 50])):
            r = read()
            if isinstance(r, bytes) and r.startswith(b"-"):
                raise SystemExit(f"error reply {r!r}")
            if shape != "reference" and any(x.startswith(b":-") for x in flat(r)):
                raise SystemExit(f"a denial or an unexpected reply: {r!r}")


if sys.argv[3:4] == ["--count"]:
    count(sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
    raise SystemExit(0)
print("| keys a request | requests a call | command µs per request | per call |")
print("|---:|---:|---:|---:|")
for keys in (1, 4):
    # The reference's pattern in the same run: INCRBY + EXPIRE per key.
    cmd("FLUSHALL")
    cmd("CONFIG", "RESETSTAT")
    reqs = [b"".join(enc(c) for d in range(keys) for c in (
        ["INCRBY", "rls-bench:d%d:10.0.%d" % (d, (i * 7 + d) % 1000), 1],
        ["EXPIRE", "rls-bench:d%d:10.0.%d" % (d, (i * 7 + d) % 1000), 3600])) for i in range(12000)]
    for j in range(0, 12000, 50):
        s.sendall(b"".join(reqs[j:j + 50]))
        for _ in range(50 * 2 * keys):
            read()
    info = cmd("INFO", "commandstats").decode()
    u = sum(int(x) for x in re.findall(r"cmdstat_(?:incrby|expire):calls=\d+,usec=(\d+)", info))
    print(f"| {keys} | reference (INCRBY + EXPIRE) | {u / 12000:.2f} | – |")
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
