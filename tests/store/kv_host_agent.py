"""A serving process of the two-host KV cache test (tests/store/test_kv_hosts.py).

    python -m tests.store.kv_host_agent ROLE MASTER DIR REPLICA_NUM

The writer holds a 32 MiB segment and the reader a 16 MiB one (so that the master's
put reservation, in the segment with the most free space, puts single replicas on the
writer's host), each with a ``KVCacheStore`` over the prompts in
``DIR/prompts.json``. ``writer`` puts every prompt's K/V, writes ``DIR/writer.ready`` and
waits to be killed. ``reader`` writes ``DIR/reader.ready``, then for each ``DIR/go<N>`` that
appears reads every prompt (``match_prefix`` then ``get``; round and round until ``DIR/end<N>``
appears where the go file says ``loop``) and writes ``DIR/pass<N>.json``: per read when it
started (``time.monotonic()``, one clock for every namespace), the tokens matched and got, whether the K/V equals the reference, how long the
get took, ``explain``'s cause and the segments (``writer``, ``reader``)
holding each chunk. ``DIR/stop`` ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

CHUNK = 16


def main() -> None:
    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore
    from tests.store.test_kvcache_agents import _kv_for

    role, master, d, replicas = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(os.path.join(d, "prompts.json")) as f:
        prompts = json.load(f)
    cfg = KVCacheConfig(chunk_tokens=CHUNK, replica_num=replicas)
    with MooncakeStore(
        master=master,
        segment_size=(32 if role == "writer" else 16) << 20,
        serve_tcp=True,
        name=role,
    ) as s:
        kv = KVCacheStore(s, tenant="t", config=cfg)
        if role == "writer":
            for p in prompts:
                kv.put(p, _kv_for(p))
            open(os.path.join(d, "writer.ready"), "w").close()
            while True:
                time.sleep(1)
        refs = [_kv_for(p) for p in prompts]
        open(os.path.join(d, "reader.ready"), "w").close()
        n = 0
        while not os.path.exists(os.path.join(d, "stop")):
            go = os.path.join(d, f"go{n}")
            if not os.path.exists(go):
                time.sleep(0.05)
                continue
            # "loop" in the go file: replay the prompts round and round until DIR/end<N>
            loop = open(go).read() == "loop"
            end = os.path.join(d, f"end{n}")
            rows = []
            i = 0
            while i < len(prompts) or (loop and not os.path.exists(end)):
                p, ref = prompts[i % len(prompts)], refs[i % len(prompts)]
                i += 1
                t0 = time.monotonic()
                matched = kv.match_prefix(p)
                g = kv.get(p)
                dt = time.monotonic() - t0
                ok = g.tokens == 0 or bool((g.kv == ref[:, :, :, : g.tokens]).all())
                ex = kv.explain(p)
                holders = []
                for k in kv.keys(p):
                    try:
                        holders.append(sorted(s.where(k).memory))
                    except KeyError:
                        holders.append([])
                rows.append(
                    {
                        "len": len(p),
                        "matched": matched,
                        "got": g.tokens,
                        "ok": ok,
                        "t": t0,
                        "s": dt,
                        "cause": ex.cause,
                        "holders": holders,
                    }
                )
            tmp = os.path.join(d, f"pass{n}.tmp")
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.rename(tmp, os.path.join(d, f"pass{n}.json"))
            n += 1


if __name__ == "__main__":
    main()
