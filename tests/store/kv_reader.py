"""A reader process for the KV cache invalidation test: loops ``get`` over prompts.

    python -m tests.store.kv_reader MASTER PROMPTS_JSON OUT CHUNK_TOKENS

Writes ``OUT.ready`` once connected, then one JSON line per get to ``OUT``: its start and
end (``time.monotonic()``, one clock for every process of the machine), the tokens
returned and whether the K/V equals the reference (tests/store/test_kvcache_agents.py's
``_kv_for``). Runs until terminated.
"""

from __future__ import annotations

import json
import signal
import sys
import time


def main() -> None:
    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore
    from tests.store.test_kvcache_agents import _kv_for

    master, prompts, out, chunk = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        sys.argv[3],
        int(sys.argv[4]),
    )
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with MooncakeStore(master=master, segment_size=0, serve_tcp=False) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=chunk))
        refs = [_kv_for(p) for p in prompts]
        with open(out, "w") as f:
            open(out + ".ready", "w").close()
            i = 0
            while not stop:
                p, ref = prompts[i % len(prompts)], refs[i % len(prompts)]
                t0 = time.monotonic()
                g = kv.get(p)
                t1 = time.monotonic()
                ok = g.tokens == 0 or bool((g.kv == ref[:, :, :, : g.tokens]).all())
                f.write(json.dumps({"start": t0, "end": t1, "tokens": g.tokens, "ok": ok}) + "\n")
                f.flush()
                i += 1


if __name__ == "__main__":
    main()
