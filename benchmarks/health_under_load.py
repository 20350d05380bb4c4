"""/health latency (p50/p99 over N polls) while K chat streams run against a roseinfer server.

Usage: python benchmarks/health_under_load.py BASE_URL STREAMS POLLS MAX_TOKENS
e.g.   python benchmarks/health_under_load.py http://127.0.0.1:8000 64 100 64
"""
import asyncio
import statistics
import sys
import threading
import time

import httpx

from roseinfer.bench.metrics import percentile

base, k, polls, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def poll_health(out, started, done):
    with httpx.Client(base_url=base, trust_env=False) as c:
        c.get("/health")
        started.wait()
        time.sleep(1.0)  # let all streams get admitted
        while len(out) < polls and not done.is_set():
            t = time.perf_counter(); r = c.get("/health"); out.append(time.perf_counter() - t)
            assert r.status_code == 200
            time.sleep(0.02)

async def streams(started, stats):
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=None,
                                 limits=httpx.Limits(max_connections=k)) as c:
        async def one(i):
            body = {"messages": [{"role": "user", "content": f"Tell me a long story about the number {i}."}],
                    "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i}
            n = 0
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
            return n
        started.set()
        t = time.perf_counter()
        chunks = await asyncio.gather(*(one(i) for i in range(k)))
        stats["wall"] = time.perf_counter() - t; stats["chunks"] = sum(chunks)

lat, started, done, stats = [], threading.Event(), threading.Event(), {}
th = threading.Thread(target=poll_health, args=(lat, started, done)); th.start()
asyncio.run(streams(started, stats)); done.set(); th.join()
print(f"{k} streams x {max_tokens} tokens: wall {stats['wall']:.1f}s, {stats['chunks']} chunks, "
      f"{k * max_tokens / stats['wall']:.0f} tok/s")
ms = [x * 1000 for x in lat]
print(f"/health under load: n={len(ms)} p50={percentile(ms, 50):.2f}ms p90={percentile(ms, 90):.2f}ms p99={percentile(ms, 99):.2f}ms "
      f"max={max(ms):.2f}ms mean={statistics.mean(ms):.2f}ms")
