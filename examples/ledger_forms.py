# Measures what candidate forms of the deadline ledger cost in Redis memory, per tracked key, on a
# throwaway redis-server (docs/how-it-works.md#the-ledgers-compact-form-measured-not-built-yet).
# Usage: pip install redis; python3 examples/ledger_forms.py [N=1000000]
import redis, random, subprocess, time, sys, zlib, socket
def free_port():
    s=socket.socket(); s.bind(("127.0.0.1",0)); p=s.getsockname()[1]; s.close(); return p
N=int(sys.argv[1]) if len(sys.argv)>1 else 1_000_000
port=free_port()
srv=subprocess.Popen(["redis-server","--port",str(port),"--bind","127.0.0.1","--save","","--appendonly","no"],stdout=subprocess.DEVNULL)
time.sleep(0.5)
r=redis.Redis(port=port)
def mem(): 
    return r.info("memory")["used_memory"]
random.seed(1)
now=int(time.time()*1000)
keys=[]; dl=[]
base=mem()
p=r.pipeline(transaction=False)
for i in range(N):
    k=f"session:{i:07d}"; d=now+3600_000+random.randrange(86400_000)
    keys.append(k); dl.append(d)
    p.set(k,"x",px=d-now)
    if i%10000==9999: p.execute()
p.execute()
m_keys=mem()
print(f"keys: {(m_keys-base)/N:.1f} B/key")
def measure(name, fill):
    b=mem(); fill(); a=mem(); print(f"{name}: {(a-b)/N:.1f} B/key"); 
def zset_one():
    p=r.pipeline(transaction=False)
    for i,(k,d) in enumerate(zip(keys,dl)):
        p.zadd("L:zset",{k:d})
        if i%10000==9999: p.execute()
    p.execute()
measure("one sorted set", zset_one); r.delete("L:zset")
def buckets(width_ms, kind, shards=1):
    def f():
        p=r.pipeline(transaction=False)
        for i,(k,d) in enumerate(zip(keys,dl)):
            s = zlib.crc32(k.encode())%shards
            b=f"L:b:{d//width_ms}:{s}"
            if kind=="zset": p.zadd(b,{k:d})
            else: p.hset(b,k,d%width_ms)
            if i%10000==9999: p.execute()
        p.execute()
    return f
for w,sh in [(1000,1),(10000,1),(60000,8),(60000,4)]:
    for kind in ["zset","hash"]:
        measure(f"{kind} buckets {w}ms x{sh} ({N*w/86400000/sh:.0f}/bucket)", buckets(w,kind,sh))
        enc=r.object("encoding", r.randomkey() if False else next(iter(r.scan_iter("L:b:*",count=100))))
        print("   encoding", enc)
        for k in r.scan_iter("L:b:*",count=10000): r.unlink(k)
def index(shards):
    def f():
        p=r.pipeline(transaction=False)
        for i,(k,d) in enumerate(zip(keys,dl)):
            p.hset(f"L:i:{zlib.crc32(k.encode())%shards}",k,d//10000)
            if i%10000==9999: p.execute()
        p.execute()
    return f
measure(f"index hash shards {N//100}", index(N//100))
srv.terminate()
