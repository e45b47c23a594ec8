"""Agents on a shared KV cache: a concurrent multi-agent replay on a tiny transformers Llama.

``--agents`` agents (10) take ``--turns`` turns (20) each, spread over two serving
processes (agent ``a`` in process ``a % 2``, so each pair of agents spans both), one tenant
per agent pair. Every prompt holds a shared system prompt, the static tool definitions, a
dynamic tool (one an MCP server loads mid-session) and the agent's history (its messages,
tool outputs and replies, growing every turn). At turn ``--change-at`` (10) the dynamic
tool's description changes, and each tenant calls ``KVCacheStore.invalidate`` of the old
one's tag. Two prompt layouts run one after the other, each in its own model namespace:

* ``tools-first``: system, static tools, dynamic tool, history: the change costs the
  whole history once;
* ``appended``: system, static tools, history, dynamic tool (dynamic tools appended after
  the history): the change costs only the dynamic tool's tokens, which every turn
  computes anyway.

Each request runs as a serving instance would: ``match_prefix``, ``get`` of the hit as a
``DynamicCache``, prefill of the rest, first token's logits (TTFT), then ``put`` with a
breakpoint where the next turn's prompt stops sharing this one (the prompt's end, or the
end of the history in the appended layout) and the dynamic tool tagged. The same prompt
is then prefilled in full (TTFT without reuse); the logits must agree within float
rounding. Counted per layout: TTFT p50/p99 with and without reuse over the warm turns
(from turn 1), token hit rate before the change (turns 1 .. change-1) and after it, stale
serves (a hit whose K/V differs from the full prefill's K/V of the same tokens: K/V of other
text served), and cross-tenant hits (a probe tenant that never stores anything looks every
prompt up).

    .venv/bin/python benchmarks/agent_bench.py                 # 10 agents x 20 turns
    .venv/bin/python benchmarks/agent_bench.py --smoke         # 4 agents x 4 turns (CI)
    .venv/bin/python benchmarks/agent_bench.py --hosts 2       # the processes on 2 emulated hosts
    .venv/bin/python benchmarks/agent_bench.py --gate --markdown out.md

Gates (``--gate`` exits 1 when one fails), on the appended layout: TTFT p50 with reuse at
least 5x and p99 at least 3x better than without; token hit rate at least 85% before the
change (both layouts) and 80% after it; no stale serve and no cross-tenant hit in either.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAYOUTS = ("tools-first", "appended")
_children: list = []


def _kill_children():
    from tests.faults import kill_group

    for p in _children:
        kill_group(p)


# ---------------------------------------------------------------------- prompts
class Agents:
    """The token streams of the replay: deterministic from the seed, equal in every process."""

    def __init__(self, a):
        import torch

        self.a = a
        g = torch.Generator().manual_seed(a.seed)
        self.system = torch.randint(3, a.vocab, (a.system_tokens,), generator=g).tolist()
        self.tools = torch.randint(3, a.vocab, (a.tool_tokens,), generator=g).tolist()
        # the dynamic tool (an MCP server's, loaded mid-session) before and after its change
        self.dynamic = [
            torch.randint(3, a.vocab, (a.dynamic_tool_tokens,), generator=g).tolist()
            for _version in range(2)
        ]

    def turn_tokens(self, agent: int, turn: int) -> list:
        """What the agent's history gains in ``turn``: a message, a tool output, a reply."""
        import torch

        g = torch.Generator().manual_seed(self.a.seed * 100_003 + agent * 1009 + turn)
        return torch.randint(3, self.a.vocab, (self.a.turn_tokens,), generator=g).tolist()

    def prompt(self, layout: str, agent: int, turn: int, history: list) -> tuple:
        """``(tokens, breakpoint, dynamic tool's range, its version)`` of a request."""
        version = int(turn >= self.a.change_at)
        dyn = self.dynamic[version]
        head = self.system + self.tools
        if layout == "tools-first":
            toks = head + dyn + history
            return toks, len(toks), (len(head), len(head) + len(dyn)), version
        toks = head + history + dyn
        start = len(head) + len(history)
        return toks, start, (start, start + len(dyn)), version


# ---------------------------------------------------------------------- serving process
def _worker() -> None:
    """A serving process: commands on stdin (JSON lines), one result line each on stdout."""
    import torch

    sys.path.insert(0, REPO)
    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore
    from tests.store.tiny_models import tiny_llama

    torch.set_num_threads(1)
    a = argparse.Namespace(**json.loads(sys.argv[sys.argv.index("--worker") + 1]))
    me = a.worker_index
    agents = Agents(a)
    model = tiny_llama(a.seed, layers=a.layers, vocab=a.vocab, hidden=a.hidden)
    store = MooncakeStore(
        master=a.master,
        segment_size=a.segment_mib << 20,
        serve_tcp=a.serve_tcp,
        name=f"server{me}",
    )
    mine = [ag for ag in range(a.agents) if ag % 2 == me]
    histories = {ag: [] for ag in mine}
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        layout, turn = cmd["layout"], cmd["turn"]
        cfg = KVCacheConfig(chunk_tokens=a.chunk, model=f"tiny-{layout}")
        if turn == 0:
            histories = {ag: [] for ag in mine}
            tenants = {
                t: KVCacheStore(store, tenant=f"tenant{t}", config=cfg)
                for t in {ag // 2 for ag in mine}
            }
            probe = KVCacheStore(store, tenant="probe", config=cfg)  # stores nothing, ever
        records, invalidated = [], 0
        if cmd.get("invalidate"):
            invalidated = sum(kv.invalidate(cmd["invalidate"]) for kv in tenants.values())
        for ag in mine:
            histories[ag] = histories[ag] + agents.turn_tokens(ag, turn)
            toks, bp, tools, version = agents.prompt(layout, ag, turn, histories[ag])
            kv = tenants[ag // 2]
            t = torch.tensor(toks)
            with torch.no_grad():
                t0 = time.perf_counter()
                n = min(kv.match_prefix(t), len(toks) - 1)
                hit = kv.get(t, n)
                n = hit.tokens
                out_r = model(t[n:].unsqueeze(0), cache=hit.to_dynamic_cache(), use_cache=True)
                logits = out_r.logits[0, -1]
                ttft = time.perf_counter() - t0
                kv.put(
                    t,
                    out_r.cache,
                    breakpoints=sorted({bp, len(toks)}),
                    tags={f"tools@v{version}": tools},
                )
                t0 = time.perf_counter()
                full = model(t.unsqueeze(0), use_cache=True)
                ttft_full = time.perf_counter() - t0
            diff = (full.logits[0, -1] - logits).abs().max().item()
            stale = False
            if n:
                for li, layer in enumerate(full.cache.layers):
                    ref_k, ref_v = layer.keys[0, :, :n], layer.values[0, :, :n]
                    got_k, got_v = hit.kv[li, 0], hit.kv[li, 1]
                    if not (
                        torch.allclose(got_k, ref_k, atol=1e-4, rtol=0)
                        and torch.allclose(got_v, ref_v, atol=1e-4, rtol=0)
                    ):
                        stale = True
            records.append(
                {
                    "agent": ag,
                    "turn": turn,
                    "tokens": len(toks),
                    "hit": n,
                    "ttft_s": ttft,
                    "ttft_full_s": ttft_full,
                    "logit_diff": diff,
                    "stale": stale,
                    "cross_tenant": probe.match_prefix(t),
                }
            )
        print(json.dumps({"records": records, "invalidated": invalidated}), file=out, flush=True)
    store.close()


# ---------------------------------------------------------------------- driver
def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _summary(records: list, a) -> dict:
    warm = [r for r in records if r["turn"] >= 1]
    before = [r for r in warm if r["turn"] < a.change_at]
    after = [r for r in records if r["turn"] >= a.change_at]

    def rate(rs):
        tok = sum(r["tokens"] for r in rs)
        return sum(r["hit"] for r in rs) / tok if tok else 0.0

    p50 = _pct([r["ttft_s"] for r in warm], 50)
    p99 = _pct([r["ttft_s"] for r in warm], 99)
    f50 = _pct([r["ttft_full_s"] for r in warm], 50)
    f99 = _pct([r["ttft_full_s"] for r in warm], 99)
    return {
        "requests": len(records),
        "ttft_p50_ms": 1000 * p50,
        "ttft_p99_ms": 1000 * p99,
        "ttft_full_p50_ms": 1000 * f50,
        "ttft_full_p99_ms": 1000 * f99,
        "p50_speedup": f50 / p50,
        "p99_speedup": f99 / p99,
        "hit_rate_before": rate(before),
        "hit_rate_after": rate(after),
        "stale_serves": sum(r["stale"] for r in records),
        "cross_tenant_hits": sum(1 for r in records if r["cross_tenant"]),
        "max_logit_diff": max(r["logit_diff"] for r in records),
    }


def _spawn_workers(a, plan: dict, topo=None) -> list:
    workers = []
    for i in range(2):
        cfg = dict(plan, worker_index=i)
        argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        if topo is not None:
            from tests import netns

            env["MOONCAKE_HOST_ID"] = f"agent-host-{i}"
            p = netns.run_in(
                topo.hosts[i], argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        else:
            p = subprocess.Popen(
                argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
            )
        _children.append(p)
        workers.append(p)
    for p in workers:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("agent_bench: a serving process died at start")
    return workers


def _replay(a, master: str, topo=None) -> dict:
    plan = {
        k: getattr(a, k)
        for k in (
            "agents",
            "turns",
            "change_at",
            "system_tokens",
            "tool_tokens",
            "dynamic_tool_tokens",
            "turn_tokens",
            "chunk",
            "seed",
            "vocab",
            "layers",
            "hidden",
            "segment_mib",
        )
    }
    plan["master"] = master
    plan["serve_tcp"] = topo is not None
    workers = _spawn_workers(a, plan, topo)
    results = {}
    try:
        for layout in LAYOUTS:
            records, invalidated = [], 0
            for turn in range(a.turns):
                cmd = {"op": "turn", "layout": layout, "turn": turn}
                if turn == a.change_at:
                    cmd["invalidate"] = "tools@v0"
                for p in workers:
                    p.stdin.write((json.dumps(cmd) + "\n").encode())
                    p.stdin.flush()
                for p in workers:
                    line = p.stdout.readline()
                    if not line:
                        raise RuntimeError(
                            f"agent_bench: a serving process died in {layout} turn {turn}"
                        )
                    got = json.loads(line)
                    records += got["records"]
                    invalidated += got["invalidated"]
            results[layout] = dict(_summary(records, a), invalidated_chunks=invalidated)
        for p in workers:
            p.stdin.write(b'{"op": "exit"}\n')
            p.stdin.flush()
        for p in workers:
            p.wait(timeout=60)
    finally:
        _kill_children()
    return results


def _start_master(host: str = "127.0.0.1", ns: str | None = None) -> str:
    from tests.store import store_agents as sa

    m = sa.start_master(host=host, ns=ns)
    atexit.register(sa.cleanup)  # its log and port file
    _children.append(m.p)
    return m.address


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--change-at", type=int, default=10, help="turn at which a tool changes")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--tool-tokens", type=int, default=512, help="the static tool definitions")
    ap.add_argument(
        "--dynamic-tool-tokens", type=int, default=64, help="the dynamic tool, which changes"
    )
    ap.add_argument("--turn-tokens", type=int, default=96, help="history gained per turn")
    ap.add_argument("--chunk", type=int, default=64, help="KVCacheConfig.chunk_tokens")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--segment-mib", type=int, default=256)
    ap.add_argument("--hosts", type=int, default=1, choices=(1, 2))
    ap.add_argument("--link-rate", default="2G", help="with --hosts 2: each host link's rate")
    ap.add_argument("--smoke", action="store_true", help="4 agents x 4 turns, change at 2")
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        _worker()
        return 0
    if a.smoke:
        a.agents, a.turns, a.change_at, a.system_tokens, a.tool_tokens = 4, 4, 2, 512, 256
    if not 0 < a.change_at < a.turns or a.agents < 2:
        ap.error("need --agents >= 2 and 0 < --change-at < --turns")
    atexit.register(_kill_children)
    sys.path.insert(0, REPO)
    load0 = os.getloadavg()[0]
    if a.hosts == 2:
        from multihost_bench import parse_rate

        from tests import netns

        ok, why = netns.available()
        if not ok:
            print(f"agent_bench --hosts 2: skipped: network namespaces: {why}")
            return 0
        with netns.hosts(2, "mcagb", rate_bit=parse_rate(a.link_rate)) as topo:
            master = _start_master(topo.addr[topo.hosts[0]], topo.hosts[0])
            res = _replay(a, master, topo)
    else:
        master = _start_master()
        res = _replay(a, master)
    where = "1 host" if a.hosts == 1 else f"2 emulated hosts, {a.link_rate}bit/s links"
    lines = [
        f"{a.agents} agents x {a.turns} turns over 2 serving processes ({where}), one tenant per "
        f"agent pair; system {a.system_tokens} tokens, static tools {a.tool_tokens}, dynamic "
        f"tool {a.dynamic_tool_tokens}, "
        f"+{a.turn_tokens} tokens of history per turn, tool change at turn {a.change_at}, chunk "
        f"{a.chunk}; tiny Llama ({a.layers} layers, hidden {a.hidden}) on the CPU; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load {load0:.1f} before",
        "",
        "| layout | TTFT p50 reuse / full (ms) | p50 speedup | TTFT p99 reuse / full (ms) | p99 speedup "
        "| hit rate before change | after | stale serves | cross-tenant hits | chunks invalidated "
        "| max logit diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, r in res.items():
        lines.append(
            f"| {layout} | {r['ttft_p50_ms']:.1f} / {r['ttft_full_p50_ms']:.1f} | {r['p50_speedup']:.1f}x "
            f"| {r['ttft_p99_ms']:.1f} / {r['ttft_full_p99_ms']:.1f} | {r['p99_speedup']:.1f}x "
            f"| {100 * r['hit_rate_before']:.1f}% | {100 * r['hit_rate_after']:.1f}% "
            f"| {r['stale_serves']} | {r['cross_tenant_hits']} | {r['invalidated_chunks']} "
            f"| {r['max_logit_diff']:.1e} |"
        )
    ap_ = res["appended"]
    gates = {
        "TTFT p50 >= 5x with reuse (appended)": ap_["p50_speedup"] >= 5,
        "TTFT p99 >= 3x with reuse (appended)": ap_["p99_speedup"] >= 3,
        "hit rate before the change >= 85% (both layouts)": all(
            r["hit_rate_before"] >= 0.85 for r in res.values()
        ),
        "hit rate after the change >= 80% (appended)": ap_["hit_rate_after"] >= 0.80,
        "0 stale serves": all(r["stale_serves"] == 0 for r in res.values()),
        "0 cross-tenant hits": all(r["cross_tenant_hits"] == 0 for r in res.values()),
        "logits equal within float rounding": all(r["max_logit_diff"] < 1e-4 for r in res.values()),
    }
    lines.append("")
    lines += [f"gate {'PASS' if ok else 'FAIL'}: {name}" for name, ok in gates.items()]
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"layouts": res, "gates": gates, "args": vars(a)}, f, indent=1)
    correct = (
        gates["0 stale serves"]
        and gates["0 cross-tenant hits"]
        and gates["logits equal within float rounding"]
    )
    if not correct:
        return 1
    return 1 if a.gate and not all(gates.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
