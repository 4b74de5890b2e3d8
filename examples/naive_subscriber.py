# Copied from shared/baselines/naive_subscriber.py: the baseline of examples/mass_expiry.rs.
"""The naive subscriber, as blog posts write it: SUBSCRIBE to __keyevent@0__:expired and, for each
event on delay:task:<id>, HGET the detail from the hash delay:detail and HDEL it, one round trip each.
Raw RESP over a socket, so it needs no client library.

Usage: python3 naive_subscriber.py PORT N   -- prints "ready", then "done <unix time>" after N tasks."""
import socket, sys, time

port, n = int(sys.argv[1]), int(sys.argv[2])

def cmd(*parts):
    out = b"*%d\r\n" % len(parts)
    for p in parts:
        p = p if isinstance(p, bytes) else str(p).encode()
        out += b"$%d\r\n%s\r\n" % (len(p), p)
    return out

class Conn:
    def __init__(self):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.f = self.s.makefile("rb")
    def send(self, *parts):
        self.s.sendall(cmd(*parts))
    def read(self):
        line = self.f.readline()
        t = line[:1]
        if t in (b"+", b"-", b":"):
            return line[1:-2]
        if t == b"$":
            ln = int(line[1:-2])
            return None if ln < 0 else self.f.read(ln + 2)[:-2]
        if t == b"*":
            return [self.read() for _ in range(int(line[1:-2]))]
        raise RuntimeError(line)

sub, db = Conn(), Conn()
sub.send("SUBSCRIBE", "__keyevent@0__:expired")
sub.read()
print("ready", flush=True)
done = 0
while done < n:
    msg = sub.read()
    key = msg[2]
    if not key.startswith(b"delay:task:"):
        continue
    tid = key.rsplit(b":", 1)[-1]
    db.send("HGET", "delay:detail", tid)
    detail = db.read()
    if detail is None:
        continue
    db.send("HDEL", "delay:detail", tid)
    db.read()
    done += 1
print(f"done {time.time():.6f}", flush=True)
