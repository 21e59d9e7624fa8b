#!/usr/bin/env python3
"""16 concurrent clients' fixed-window checks against one Redis, sent one
of several ways (perf/group_commit.sh, issue 43's group-commit experiment).

    redis_batch.py PORT N SHAPE KEYN [--stats]

N requests in all (a multiple of 16), from 16 clients, each with KEYN (1
or 4) descriptors of its own (keys per client: its address, user, tenant,
a generic key), limits never reached (50 000 an hour). SHAPE:
  reference  16 connections; per request envoyproxy/ratelimit's INCRBY +
             EXPIRE per descriptor, pipelined in one write, then wait
  floor      16 connections; per request one EVALSHA of
             perf/floors/fixed_window.lua, then wait
  batchB     16/B connections (B = 1, 2, 4, 8, 16); per call one EVALSHA
             of perf/floors/fixed_window_batch.lua carrying B clients'
             requests, then wait: what a group commit sends when B requests
             arrived while the previous call was in flight
Each connection makes N/16 calls. The scripts are loaded (SCRIPT LOAD) on
a control connection. Every reply is checked: an error reply, a script
answering the wrong number of values or a denial exits 1.

--stats: FLUSHALL and CONFIG RESETSTAT before, then print one line
  "requests command_us cpu_us" for the run: command_us = the usec of
  cmdstat_evalsha (the reference: incrby + expire) per request, cpu_us =
  used_cpu_user_main_thread + used_cpu_sys_main_thread (INFO cpu, Redis 7)
  gained during the run per request. Only the standard library."""
import os
import selectors
import socket
import sys
import time

LIMIT, WINDOW_US = 50000, 3600000000
HERE = os.path.dirname(os.path.abspath(__file__))


def encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Incomplete(Exception):
    pass


def parse(buf, pos):
    """One reply at buf[pos:] -> (value, next pos); raises Incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind, body = buf[pos:pos + 1], buf[pos + 1:end]
    pos = end + 2
    if kind == b"-":
        raise SystemExit("redis_batch: error reply: " + body.decode(errors="replace"))
    if kind == b":":
        return int(body), pos
    if kind == b"+":
        return body, pos
    if kind == b"$":
        n = int(body)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise Incomplete
        return buf[pos:pos + n], pos + n + 2
    if kind == b"*":
        items = []
        for _ in range(int(body)):
            v, pos = parse(buf, pos)
            items.append(v)
        return items, pos
    raise SystemExit("redis_batch: unexpected reply " + repr(buf[pos - 1:pos + 20]))


def command(sock, *args):
    sock.sendall(encode(args))
    buf = b""
    while True:
        try:
            return parse(buf, 0)[0]
        except Incomplete:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise SystemExit("redis_batch: connection closed")
            buf += chunk


def client_keys(c, keyn, now_s):
    """(script keys, reference keys) of client c."""
    script = [f"rls:bench:remote_address:10.0.0.{c + 1}",
              f"rls:bench:user_path:6:user{c + 1}|10:/api/items",
              f"rls:bench:tenant:t{c + 1}",
              f"rls:bench:generic_key_global:global{c + 1}"][:keyn]
    start = now_s - now_s % 3600
    ref = [f"bench_remote_address_10.0.0.{c + 1}_{start}",
           f"bench_user_user{c + 1}_path_/api/items_{start}",
           f"bench_tenant_t{c + 1}_{start}",
           f"bench_generic_key_global{c + 1}_{start}"][:keyn]
    return script, ref


def streams(shape, keyn, shas):
    """[(payload, check)] per connection; check(replies) validates one call."""
    now_s = int(time.time())
    out = []
    if shape in ("reference", "floor"):
        for c in range(16):
            script, ref = client_keys(c, keyn, now_s)
            if shape == "reference":
                cmds = []
                for k in ref:
                    cmds += [["INCRBY", k, 1], ["EXPIRE", k, 3600]]
                out.append((b"".join(encode(x) for x in cmds), len(cmds), "ref", keyn))
            else:
                args = ["EVALSHA", shas["floor"], keyn] + script
                for _ in script:
                    args += [LIMIT, WINDOW_US]
                out.append((encode(args), 1, "script", keyn))
        return out
    kind = shape.rstrip("0123456789")
    if kind not in ("batch", "lean", "incr"):
        raise SystemExit(f"redis_batch: unknown shape {shape}")
    b = int(shape[len(kind):])
    if b < 1 or 16 % b:
        raise SystemExit("redis_batch: B must divide 16")
    for s in range(16 // b):
        if kind != "batch":
            keys = []
            for c in range(s * b, s * b + b):
                keys += client_keys(c, keyn, now_s)[0]
            argv = [1, LIMIT, WINDOW_US] + ["1" * keyn] * b
            out.append((encode(["EVALSHA", shas[kind], len(keys)] + keys + argv), 1, "script", b * keyn))
            continue
        keys, argv = [], [b]
        for c in range(s * b, s * b + b):
            script, _ = client_keys(c, keyn, now_s)
            keys += script
            argv.append(keyn)
            for _ in script:
                argv += [LIMIT, WINDOW_US]
        out.append((encode(["EVALSHA", shas["batch"], len(keys)] + keys + argv), 1, "script", b * keyn))
    return out


def check(kind, want, replies):
    if kind == "ref":
        for i, v in enumerate(replies):
            if not isinstance(v, int) or (i % 2 == 1 and v != 1):
                raise SystemExit(f"redis_batch: reference reply {v!r}")
        return
    v = replies[0]
    if not isinstance(v, list) or len(v) != want + 1:
        raise SystemExit(f"redis_batch: a script answered {v!r}, want 1 + {want} values")
    if min(v[1:]) < 0:
        raise SystemExit(f"redis_batch: a denial: {v!r}")


def run(port, n, shape, keyn, shas):
    calls = n // 16
    conns = []
    sel = selectors.DefaultSelector()
    for payload, nrep, kind, want in streams(shape, keyn, shas):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        st = {"sock": sock, "payload": payload, "nrep": nrep, "kind": kind,
              "want": want, "left": calls, "buf": b"", "got": []}
        conns.append(st)
        sel.register(sock, selectors.EVENT_READ, st)
    for st in conns:
        st["sock"].sendall(st["payload"])
        st["left"] -= 1
    active = len(conns)
    while active:
        for key, _ in sel.select():
            st = key.data
            chunk = st["sock"].recv(1 << 20)
            if not chunk:
                raise SystemExit("redis_batch: connection closed")
            buf = st["buf"] + chunk
            pos = 0
            while True:
                try:
                    v, pos = parse(buf, pos)
                except Incomplete:
                    break
                st["got"].append(v)
                if len(st["got"]) == st["nrep"]:
                    check(st["kind"], st["want"], st["got"])
                    st["got"] = []
                    if st["left"]:
                        st["left"] -= 1
                        st["sock"].sendall(st["payload"])
                    else:
                        sel.unregister(st["sock"])
                        active -= 1
            st["buf"] = buf[pos:]
    for st in conns:
        st["sock"].close()


def info(ctl, section):
    text = command(ctl, "INFO", section).decode()
    out = {}
    for line in text.split("\r\n"):
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v
    return out


def main():
    port, n, shape, keyn = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    stats = "--stats" in sys.argv[5:]
    if n % 16 or n <= 0 or keyn not in (1, 4):
        raise SystemExit("redis_batch: N a positive multiple of 16, KEYN 1 or 4")
    ctl = socket.create_connection(("127.0.0.1", port))
    shas = {}
    for name, f in (("floor", "fixed_window.lua"), ("batch", "fixed_window_batch.lua"),
                    ("lean", "fixed_window_batch_lean.lua"),
                    ("incr", "fixed_window_batch_incr.lua")):
        with open(os.path.join(HERE, "floors", f), "rb") as fh:
            shas[name] = command(ctl, "SCRIPT", "LOAD", fh.read()).decode()
    if stats:
        command(ctl, "FLUSHALL")
        command(ctl, "CONFIG", "RESETSTAT")
        c0 = info(ctl, "cpu")
    run(port, n, shape, keyn, shas)
    if stats:
        c1 = info(ctl, "cpu")
        cs = info(ctl, "commandstats")
        usec = calls = 0
        for name in ("cmdstat_evalsha", "cmdstat_incrby", "cmdstat_expire"):
            if name in cs:
                f = dict(x.split("=") for x in cs[name].split(","))
                if int(f.get("failed_calls", 0)) or int(f.get("rejected_calls", 0)):
                    raise SystemExit(f"redis_batch: {name} failed calls")
                usec += int(f["usec"])
                calls += int(f["calls"])
        cpu = sum(float(c1[k]) - float(c0[k])
                  for k in ("used_cpu_user_main_thread", "used_cpu_sys_main_thread"))
        print(f"{n} {usec / n:.3f} {cpu * 1e6 / n:.3f}")


main()
