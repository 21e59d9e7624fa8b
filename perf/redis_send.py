#!/usr/bin/env python3
"""Send one request N times over one connection, waiting for each request's
replies before the next (perf/redis_floors.sh).

    redis_send.py PORT N CMD ARG... [';;' CMD ARG...]...

A request is one command or several separated by ';;', written in one
send (pipelined, as envoyproxy/ratelimit sends its INCRBY + EXPIRE per
descriptor). Exits 1 on an error reply, and on a script call (FCALL,
EVALSHA) answering fewer than two values: every check answers now_us and
at least one number per tier, so one value is a "late" reply or a call
that named its keys wrong. Only the standard library."""
import socket
import sys


def encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Reader:
    def __init__(self, sock):
        self.sock, self.buf, self.pos = sock, b"", 0

    def line(self):
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = self.buf[self.pos:end]
                self.pos = end + 2
                return line
            self.more()

    def more(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise SystemExit("redis_send: connection closed")
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0

    def reply(self):
        line = self.line()
        kind = line[:1]
        if kind == b"-":
            raise SystemExit("redis_send: error reply: " + line.decode(errors="replace"))
        if kind in (b"*", b"%", b"~"):
            n = int(line[1:])
            for _ in range(max(n, 0) * (2 if kind == b"%" else 1)):
                self.reply()
            return n
        elif kind == b"$":
            n = int(line[1:])
            if n >= 0:
                while len(self.buf) - self.pos < n + 2:
                    self.more()
                self.pos += n + 2


def main():
    port, n = int(sys.argv[1]), int(sys.argv[2])
    cmds, cur = [], []
    for a in sys.argv[3:]:
        if a == ";;":
            cmds.append(cur)
            cur = []
        else:
            cur.append(a)
    cmds.append(cur)
    payload = b"".join(encode(c) for c in cmds)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    r = Reader(sock)
    scripts = [c[0].lower() in ("fcall", "evalsha") for c in cmds]
    for _ in range(n):
        sock.sendall(payload)
        for script in scripts:
            got = r.reply()
            if script and (got is None or got < 2):
                raise SystemExit(f"redis_send: a script call answered {got} values")


main()
