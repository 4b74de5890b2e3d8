# The intake's take script in isolation: Redis's CPU per event of a mass expiry's batches, for
# this worktree's script and for the same script at other git revisions, alternating, on a
# throwaway redis-server (docs/performance.md#mass-expiry). Every batch is 1,024 live expiries
# (`M`: key, second, place) of keys whose deadlines share one second of a ledger holding all of
# them, as `src/store/intake.rs` sends them in a storm: this worktree's script with the events'
# lines written beside it in one transaction (`MULTI`, `HSET … ID:b`, `EVALSHA`, `EXEC`: see
# `LINES_APART`), a revision's as that revision sent them. Redis's CPU is `INFO cpu` around the
# batches. The first round checks that every script answers and writes the same, byte for byte
# (a record whose lines were kept apart compared as the one record they make).
#
# Usage: python3 examples/take_script.py [--rev REV]... [--batches 98] [--rounds 5]
# No Python package needed: it speaks RESP itself.
import os, random, socket, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["src/store/handled/recalled.lua", "src/store/ledger/bucket.lua", "src/store/intake/take.lua"]


def arg(name, default):
    a = sys.argv
    return a[a.index(name) + 1] if name in a else default


def script_at(rev):
    if rev is None:
        return "".join(open(os.path.join(ROOT, p)).read() for p in PARTS)
    return "".join(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{p}"], check=True, capture_output=True, text=True).stdout for p in PARTS)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def enc(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        for _ in range(100):
            try:
                self.s = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        self.f = self.s.makefile("rb")

    def call(self, *args):
        self.s.sendall(enc(args))
        return self.read()

    def read(self):
        line = self.f.readline()
        t, rest = line[:1], line[1:-2]
        if t == b"-":
            raise RuntimeError(rest.decode())
        if t == b"+":
            return rest
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            return None if n < 0 else self.f.read(n + 2)[:-2]
        if t == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected reply {line!r}")


# `src/store/intake.rs`: a batch's lines at least this long are written beside the script.
LINES_APART = 8 * 1024


def records(flat):
    """The intake's records, each as one record: one that names only the events won (`S`) joined
    with the lines its take kept apart (`ID:b`), as the take-over reads it."""
    h = dict(zip(flat[::2], flat[1::2]))
    out = []
    for f, v in h.items():
        if f.endswith(b":b"):
            continue
        if v.startswith(b"S\n"):
            v = b"C\n" + v[2:] + b"\n" + h[f + b":b"]
        out.append((f, v))
    return sorted(out)


def main():
    revs = [a for i, a in enumerate(sys.argv) if i > 0 and sys.argv[i - 1] == "--rev"]
    batches, rounds, size = int(arg("--batches", 98)), int(arg("--rounds", 5)), 1024
    builds = [(rev, script_at(rev)) for rev in revs] + [("this worktree", script_at(None))]
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        r = Conn(port)
        P = "keywatch:"
        second = int(time.time()) - 1
        now_ms = second * 1000 + 1500
        keys = [f"delay:task:{i}" for i in range(batches * size)]
        per_event = {name: [] for name, _ in builds}
        reference = None
        for rnd in range(rounds):
            for name, body in builds:
                sha = r.call("SCRIPT", "LOAD", body).decode()
                r.call("FLUSHALL")
                random.seed(7)
                for i in range(0, len(keys), 1000):
                    fields = []
                    for k in keys[i:i + 1000]:
                        fields += [k, random.randint(0, 999)]
                    r.call("HSET", f"{P}ledger:0:at:{second}", *fields)
                calls = []
                for b in range(batches):
                    ks = keys[b * size:(b + 1) * size]
                    blob = "\n".join('{"kind":"expired","db":0,"key":"%s","observed_ms":%d,"ttl_ms":null,"recovered":false,"source":"127.0.0.1:6379","rule":null,"attempt":0,"failing_since":null}' % (k, now_ms) for k in ks)
                    events = []
                    for j, k in enumerate(ks):
                        events += [k, second, "00c0ffee00c0ffee:1"]
                    apart = name == "this worktree" and len(blob) >= LINES_APART
                    call = enc(["EVALSHA", sha, 6, f"{P}ledger:0:minutes", f"{P}ledger:0:poked", f"{P}ledger:0:poked-deadline",
                                f"{P}intake", f"{P}intake:events", f"{P}fields:0:minutes", now_ms, now_ms + 2000, 10,
                                now_ms + 30000, "me", f"{P}ledger:0:handled:", f"{P}claim:", f"{P}claims:", 0, f"b:{b}",
                                "" if apart else blob, "M" * size, f"{P}ledger:0:at:", 60000, 55000, 100, f"{P}fields:0:at:", ""] + events)
                    if apart:
                        call = enc(["MULTI"]) + enc(["HSET", f"{P}intake:events", f"b:{b}:b", blob]) + call + enc(["EXEC"])
                    calls.append((apart, call))
                cpu = lambda: sum(float(l.split(":")[1]) for l in r.call("INFO", "cpu").decode().split("\r\n") if l.startswith(("used_cpu_user:", "used_cpu_sys:")))
                before = cpu()
                answers = []
                for apart, c in calls:
                    r.s.sendall(c)
                    if apart:
                        r.read(), r.read(), r.read()
                        answers.append(r.read()[1])
                    else:
                        answers.append(r.read())
                us = (cpu() - before) * 1e6 / (batches * size)
                per_event[name].append(us)
                print(f"round {rnd + 1}: {name}: {us:.2f} µs of Redis CPU per event", flush=True)
                if rnd == 0:
                    minute = now_ms // 60000
                    state = (answers, sorted(r.call("HGETALL", f"{P}ledger:0:handled:{minute}")),
                             records(r.call("HGETALL", f"{P}intake:events")), r.call("ZRANGE", f"{P}intake", 0, -1, "WITHSCORES"),
                             sorted(r.call("KEYS", "*")))
                    if reference is None:
                        reference = state
                    elif state != reference:
                        print(f"  {name} answers or writes differently from {builds[0][0]}", flush=True)
                        sys.exit(1)
        print(f"\n{batches} batches of {size} live expiries, {rounds} rounds alternating; medians:")
        for name, v in per_event.items():
            v.sort()
            print(f"  {name}: {v[len(v) // 2]:.2f} µs of Redis CPU per event (runs: {', '.join(f'{x:.2f}' for x in v)})")
    finally:
        server.kill()
        server.wait()


main()
