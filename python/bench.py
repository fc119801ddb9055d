"""Exec figures of the Python SDK against a running worker, printed as JSON:
sync and asyncio exec of `true` p50/p99 (alternating, N each), and the
throughput of 256 concurrent asyncio execs. sdk's BenchmarkRemote runs it
next to the Go SDK's figures against the same worker.

    python3 bench.py SANDBOX [N]   (DSEC_HOST, DSEC_TOKEN, DSEC_TLS_CA as for any client)
"""

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsec  # noqa: E402


def pct(d, p):
    d = sorted(d)
    return d[min(len(d) - 1, (len(d) * p + 99) // 100 - 1)] * 1000


async def main(name, n):
    sync = dsec.Client().sandbox(name)
    async with dsec.aio.Client() as ac:
        asb = ac.sandbox(name)
        sync.exec(["true"])
        await asb.exec(["true"])
        s, a = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            sync.exec(["true"])
            s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asb.exec(["true"])
            a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(asb.exec(["true"]) for _ in range(256)))
        took = time.perf_counter() - t0
        assert all(r.exit_code == 0 for r in rs)
    print(json.dumps({"sync_p50_ms": pct(s, 50), "sync_p99_ms": pct(s, 99), "aio_p50_ms": pct(a, 50),
                      "aio_p99_ms": pct(a, 99), "aio_256_steps_per_s": 256 / took}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100))
