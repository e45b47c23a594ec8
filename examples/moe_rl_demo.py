"""The main job: train a small MoE language model with expert parallelism over
``"mooncake"``, survive a killed rank, and (with the store) feed rollout workers.

Run it (the README's first command does the set-up, then this)::

    .venv/bin/mooncake-demo [--steps 160] [--kill-rank 1 --kill-at 80] [--corpus PATH] [--hosts N]

``mooncake-demo`` is this file's driver: it runs ``mooncake-run``'s launcher in-process
(the control store lives there, so any rank may die, rank 0 included) with 4 training
ranks (``--role train``), draws progress bars from what the ranks report through the
control store, and at the end prints a summary table and writes a PNG plot of the loss
curve with the failure and the recovery marked (``--out``, default ``demo_out/``).

Each training rank:

* reads the corpus at run time (default: the installed Python's standard-library source,
  sorted by path, up to ``--corpus-bytes``; ``--corpus PATH`` takes any text file or
  directory) as byte-level tokens (vocabulary 256);
* holds the dense layers (embeddings, attention, norms, routers, head) replicated, data
  parallel: gradients are all-reduced with a trailing 1, so they are averaged over the
  ranks that contributed; and ``E / W`` experts of each MoE layer
  (``mooncake_ep.ExpertParallelMoE``, top-2 of ``--experts``), whose gradients come back
  through the dispatch/combine backward;
* with ``on_failure="mask"``: when ``--kill-rank`` SIGKILLs itself at ``--kill-at``, the
  survivors' ops complete over the survivors (tokens for the dead rank's experts
  contribute zero) and training goes on over three ranks;
* the launcher respawns the dead rank alone (``MOONCAKE_IS_RECOVERY=1``); it joins, gets
  the dense parameters, their Adam state and the step from ``mooncake_pg.sync_state``
  and its experts from the peer holding their latest snapshot
  (``ExpertParallelMoE.restore_experts``; snapshots every ``--snapshot-every`` steps);
* at the end every rank checks that the group is full and the dense parameters are
  bit-identical everywhere (expert shards live on their owners).

``--hosts N`` (N > 1) runs the same over N emulated hosts on this machine (network
namespaces joined by a bridge, each process with its host's hostname, so the backend
groups ranks by host: shared memory inside a host, TCP and the two-level collectives and
EP between hosts): ``--nproc / N`` training ranks per host, a ``mooncake-run`` node per
host (host 0's in this driver, run again inside host 0, with the control store and the
store master bound to host 0's address), the rollout workers on the last host, and by
default the first rank of the last host killed and respawned there. It needs root and
iproute2 (a clear message otherwise); the namespaces are deleted at the end.

Exit status 0 when the launcher succeeded and loss went down, the failure (if any) was
recovered and the dense parameters are equal on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import sysconfig
import time
from datetime import timedelta

# ============================================================================ model


def expert_class():
    """The expert MLP of both models (training and rollout): ``down(gelu(up(x)))``; the
    parameter names (``up``, ``down``) are what the published state dict carries."""
    import torch.nn as nn
    import torch.nn.functional as F

    global _Expert
    if "_Expert" not in globals():

        class Expert(nn.Module):
            def __init__(self, d, hidden):
                super().__init__()
                self.up = nn.Linear(d, hidden)
                self.down = nn.Linear(hidden, d)

            def forward(self, x):
                return self.down(F.gelu(self.up(x)))

        _Expert = Expert
    return _Expert


def _init_attention(block, d, heads):
    """The attention half of a block (the same names in the training and the rollout model)."""
    import torch.nn as nn

    block.heads = heads
    block.ln1 = nn.LayerNorm(d)
    block.qkv = nn.Linear(d, 3 * d)
    block.proj = nn.Linear(d, d)
    block.ln2 = nn.LayerNorm(d)


def _init_lm(lm, args, block_cls):
    """Embedding, positions, ``args.layers`` blocks, final norm and head, in this order."""
    import torch
    import torch.nn as nn

    d = args.d_model
    lm.emb = nn.Embedding(256, d)
    lm.pos = nn.Parameter(torch.zeros(args.seq_len, d))
    lm.blocks = nn.ModuleList([block_cls(d, args.heads, args.experts) for _ in range(args.layers)])
    lm.ln_f = nn.LayerNorm(d)
    lm.head = nn.Linear(d, 256)


def build_model(args, group=None):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import mooncake_ep

    Expert = expert_class()

    class Block(nn.Module):
        def __init__(self, d, heads, experts):
            super().__init__()
            _init_attention(self, d, heads)
            gate = nn.Linear(d, experts, bias=False)
            self.moe = mooncake_ep.ExpertParallelMoE(
                gate, [Expert(d, 2 * d) for _ in range(experts)], group, top_k=2
            )

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (
                self.qkv(self.ln1(x))
                .view(b, t, 3, self.heads, d // self.heads)
                .permute(2, 0, 3, 1, 4)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            h = self.ln2(x)
            return x + self.moe(h.reshape(b * t, d)).view(b, t, d)

    class MoELM(nn.Module):
        def __init__(self):
            super().__init__()
            _init_lm(self, args, Block)

        def forward(self, idx):
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return MoELM()


def build_rollout_model(args):
    """The same network without expert parallelism (all experts local), with a K/V-cache
    forward for serving. Parameter names equal the published state dict's."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from mooncake_ep import route_topk

    Expert = expert_class()

    class MoE(nn.Module):
        def __init__(self, d, experts):
            super().__init__()
            self.gate = nn.Linear(d, experts, bias=False)
            self.experts = nn.ModuleList([Expert(d, 2 * d) for _ in range(experts)])

        def forward(self, x):
            idx, w = route_topk(self.gate(x), 2)
            out = torch.zeros_like(x)
            for k in range(idx.shape[1]):
                for e in idx[:, k].unique().tolist():
                    sel = idx[:, k] == e
                    out[sel] += w[sel, k : k + 1].to(x.dtype) * self.experts[e](x[sel])
            return out

    class Block(nn.Module):
        def __init__(self, d, heads, experts):
            super().__init__()
            _init_attention(self, d, heads)
            self.moe = MoE(d, experts)

        def forward(self, x, past):
            t, d = x.shape
            hd = d // self.heads
            q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, hd).permute(1, 2, 0, 3)
            if past is not None:
                k = torch.cat([past[0], k], dim=1)
                v = torch.cat([past[1], v], dim=1)
            n_past = k.shape[1] - t
            mask = torch.arange(k.shape[1])[None, :] <= (torch.arange(t)[:, None] + n_past)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(a.transpose(0, 1).reshape(t, d))
            return x + self.moe(self.ln2(x)), (k, v)

    class RolloutLM(nn.Module):
        def __init__(self):
            super().__init__()
            _init_lm(self, args, Block)

        @torch.no_grad()
        def forward(self, tokens, past=None):
            """tokens int64 [t] following ``past`` (per-layer (K, V) [heads, t_past, hd] or
            None) -> (logits [t, 256], per-layer (K, V) over past + tokens)."""
            n_past = 0 if past is None else past[0][0].shape[1]
            x = self.emb(tokens) + self.pos[n_past : n_past + tokens.shape[0]]
            new = []
            for i, blk in enumerate(self.blocks):
                x, kv = blk(x, None if past is None else past[i])
                new.append(kv)
            return self.head(self.ln_f(x)), new

    return RolloutLM()


def full_state_dict(model, args):
    """Collective over the (full) group: the dense parameters plus every rank's experts
    under their global expert numbers (all_gather of the expert shards)."""
    import torch
    import torch.distributed as dist

    _rank, world = dist.get_rank(), dist.get_world_size()
    L = args.experts // world
    sd = {}
    local = []
    for name, p in model.named_parameters():
        if ".moe.experts." in name:
            local.append((name, p))
        else:
            sd[name] = p.detach().clone()
    flat = torch.cat([p.detach().reshape(-1) for _, p in local])
    out = torch.empty(world * flat.numel(), dtype=flat.dtype)
    dist.all_gather_single(out, flat)
    for r in range(world):
        chunk, off = out[r * flat.numel() : (r + 1) * flat.numel()], 0
        for name, p in local:
            head, tail = name.split(".moe.experts.")
            l, rest = tail.split(".", 1)
            sd[f"{head}.moe.experts.{r * L + int(l)}.{rest}"] = (
                chunk[off : off + p.numel()].view_as(p).clone()
            )
            off += p.numel()
    return sd


def split_parameters(model):
    """(dense parameters, expert parameters): experts are the local shards of the MoE
    layers; everything else is replicated."""
    dense, experts = [], []
    for name, p in model.named_parameters():
        (experts if ".moe.experts." in name else dense).append(p)
    return dense, experts


class _Dense:
    """The replicated part of the model as one module for ``sync_state``."""

    @staticmethod
    def of(model):
        import torch.nn as nn

        holder = nn.Module()
        holder.params = nn.ParameterList(split_parameters(model)[0])
        return holder


# ============================================================================ data


def read_corpus(path, limit):
    """Bytes of the corpus: a file, or every *.py / *.txt / *.rst file under a directory
    (sorted by path), at most ``limit`` bytes; default the Python standard library."""
    root = path or sysconfig.get_paths()["stdlib"]
    if os.path.isfile(root):
        with open(root, "rb") as f:
            return f.read(limit), root
    chunks, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        dirnames[:] = [
            d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests")
        ]
        for name in sorted(filenames):
            if not name.endswith((".py", ".txt", ".rst")):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read(limit - size)
            except OSError:
                continue
            chunks.append(data)
            size += len(data)
            if size >= limit:
                return b"".join(chunks), root
    if not chunks:
        raise SystemExit(f"moe_rl_demo: no text found under {root!r} (give --corpus PATH)")
    return b"".join(chunks), root


def get_batch(data, args, rank, step):
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + rank)
    starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch,), generator=g)
    idx = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()]).long()
    return idx[:, :-1], idx[:, 1:]


# ============================================================================ training rank


def train(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import mooncake_pg

    torch.set_num_threads(1)
    dist.init_process_group(
        "mooncake",
        pg_options=mooncake_pg.MooncakeOptions(on_failure="mask", timeout=args.op_timeout),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    ctl = _control_store()
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    raw, _ = read_corpus(args.corpus, args.corpus_bytes)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    model = build_model(args)
    moes = [blk.moe for blk in model.blocks]
    dense_params, expert_params = split_parameters(model)
    dense = _Dense.of(model)
    opt_dense = torch.optim.AdamW(dense_params, lr=args.lr, weight_decay=0.0)
    opt_experts = torch.optim.AdamW(expert_params, lr=args.lr, weight_decay=0.0)
    step, recoveries = 0, 0

    def active():
        return mooncake_pg.get_active_ranks().tolist()

    def reporter():
        return rank == min(r for r, a in enumerate(active()) if a)

    def event(kind):
        ctl.append("demo/events", f"{kind}:{step};")

    if mooncake_pg.is_joining():
        mooncake_pg.join_group(timeout=args.rejoin_timeout)
        step = mooncake_pg.sync_state(dense, opt_dense, step=0)
        for moe in moes:
            moe.restore_experts()
        print(f"[rank {rank}] rejoined at step {step}", flush=True)
        publish_after_join = True
    else:
        publish_after_join = False
        for moe in moes:
            moe.snapshot_experts()

    def admit_joiners():
        nonlocal step, recoveries
        admitted = mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks())
        if admitted:
            step = mooncake_pg.sync_state(dense, opt_dense, step=step)
            for moe in moes:
                moe.restore_experts()
            recoveries += 1
            if rank == min(r for r, a in enumerate(active()) if a and r not in admitted):
                event("recovered")

    sync = None
    published = -1

    def publish(final=False):
        """Every --publish-every steps with the full group, and once at the end: the lowest
        rank publishes (collective: every rank gathers the experts)."""
        nonlocal sync, published
        if not args.store or not all(active()) or step == published:
            return
        if not final and (step % args.publish_every or step >= args.steps):
            return
        sd = full_state_dict(model, args)  # collective
        if reporter():
            if sync is None:
                from mooncake_store import MooncakeStore, WeightSync

                sync = WeightSync(MooncakeStore(master=args.store, segment_size=0), "demo-moe-lm")
            sync.publish(sd, version=step)
            ctl.set("demo/published", str(step))
        published = step

    if publish_after_join:
        publish()  # the survivors publish right after admitting it, at the same step
    t_last, losses = time.monotonic(), []
    while step < args.steps:
        if rank == args.kill_rank and step == args.kill_at and first_start:
            event("killed")
            print(f"[rank {rank}] step {step}: SIGKILL myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = get_batch(data, args, rank, step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        opt_dense.zero_grad(set_to_none=False)
        opt_experts.zero_grad(set_to_none=False)
        loss.backward()
        flat = torch.cat(
            [p.grad.flatten() for p in dense_params] + [loss.detach().view(1), torch.ones(1)]
        )
        dist.all_reduce(flat)
        n = flat[-1].item()
        off = 0
        for p in dense_params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p) / n)
            off += p.numel()
        for p in expert_params:  # each rank's loss is a mean over its tokens: average over ranks
            if p.grad is not None:  # None: no token reached that expert since this process began
                p.grad.div_(n)
        opt_dense.step()
        opt_experts.step()
        mean_loss = flat[-2].item() / n
        losses.append(mean_loss)
        step += 1
        if step % args.snapshot_every == 0:
            for moe in moes:
                moe.snapshot_experts()
        if reporter():
            now = time.monotonic()
            tps = int(n) * args.batch * args.seq_len / max(now - t_last, 1e-9)
            ctl.append("demo/log", f"{step} {mean_loss:.5f} {tps:.0f} {int(n)};")
            ctl.set(
                "demo/status",
                json.dumps(
                    {
                        "step": step,
                        "loss": mean_loss,
                        "tokens_per_s": tps,
                        "ranks": int(n),
                        "epoch": mooncake_pg.get_epoch(),
                        "recoveries": recoveries,
                    }
                ),
            )
        t_last = time.monotonic()
        admit_joiners()
        publish()

    # the end: wait for respawned ranks, then check the replicated parameters
    deadline = time.monotonic() + args.rejoin_timeout
    while not all(active()) and time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.1)
        admit_joiners()
    publish(final=True)  # the final weights, once every rank is back
    h = hashlib.sha256()
    for p in dense_params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor(list(h.digest()), dtype=torch.uint8)
    out = torch.zeros(world, mine.numel(), dtype=torch.uint8)
    dist.all_gather_single(out, mine)
    act = active()
    equal = all(torch.equal(out[r], mine) for r, a in enumerate(act) if a)
    if reporter():
        ctl.set(
            "demo/final",
            json.dumps(
                {
                    "steps": step,
                    "active": act,
                    "epoch": mooncake_pg.get_epoch(),
                    "dense_equal": equal,
                    "recoveries": recoveries,
                }
            ),
        )
    dist.destroy_process_group()
    return 0 if equal and all(act) else 1


# ============================================================================ rollout worker


def rollout(args) -> int:
    """Pulls each new published version (WeightSync, whole versions only, never older) and
    generates continuations of prompts that share a long prefix, reusing its K/V from the
    store (KVCacheStore; K/V are per weight version). Reports to the control store."""
    import torch

    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore, WeightSync

    torch.set_num_threads(1)
    ctl = _control_store()
    store = MooncakeStore(master=args.store, segment_size=0)
    reader = WeightSync(store, "demo-moe-lm")
    model = build_rollout_model(args)
    raw, _ = read_corpus(args.corpus, args.corpus_bytes)
    shared = list(raw[: args.prompt_prefix])  # e.g. a shared system prompt
    prompts = [
        shared + list(raw[1000 * (i + 1) : 1000 * (i + 1) + 16]) for i in range(args.prompts)
    ]
    # K/V is keyed by the weight version this reader installed: after a pull of version
    # v, K/V computed with an older policy is never served (a miss, "other_weight_version")
    kv = KVCacheStore(
        store,
        tenant="rollout",
        config=KVCacheConfig(chunk_tokens=args.chunk_tokens, model="demo-moe-lm"),
        weights=reader,
    )
    served, max_diff, sample, causes, wrong_version = [], 0.0, "", {}, 0
    me = os.environ.get("SIDECAR_INDEX", "0")

    def report():
        ctl.set(
            f"demo/rollout/{me}",
            json.dumps(
                {
                    "versions": served,
                    "hit_tokens": kv.stats.hit_tokens,
                    "miss_tokens": kv.stats.miss_tokens,
                    "miss_causes": causes,
                    "wrong_version": wrong_version,
                    "max_logits_diff": max_diff,
                    "sample": sample,
                }
            ),
        )

    while True:
        done = ctl.check(["demo/final"])
        latest = reader.latest_version() if ctl.check(["demo/published"]) else -1
        if latest > (served[-1] if served else -1):
            res = reader.pull(into=model)
            if res.installed:
                v = res.version
                for i, prompt in enumerate(prompts):
                    toks = torch.tensor(prompt, dtype=torch.int64)
                    n = kv.match_prefix(toks)
                    if n < len(toks):  # why the prefix ends there (the causes' table)
                        cause = kv.explain(toks).cause
                        causes[cause] = causes.get(cause, 0) + 1
                    past = None
                    if n:
                        hit = kv.get(toks, n)
                        wrong_version += hit.version != v
                        past = [(k.contiguous(), vv.contiguous()) for k, vv in hit.layers()]
                        n = hit.tokens
                    logits, full = model(toks[n:], past)
                    kv.put(toks, full)
                    if i == 1 and n:  # reuse must not change the logits
                        ref, _ = model(toks, None)
                        max_diff = max(max_diff, (ref[-1] - logits[-1]).abs().max().item())
                    out, nxt = [], int(logits[-1].argmax())
                    for _ in range(args.gen_tokens):
                        if toks.numel() + len(out) >= args.seq_len:
                            break
                        out.append(nxt)
                        lg, full = model(torch.tensor([nxt]), full)
                        nxt = int(lg[-1].argmax())
                    if i == 0:
                        sample = bytes(out).decode("utf-8", "replace")
                kv.retire_versions(keep=2)  # older policies' K/V will never be served again
                served.append(v)
                report()
        if done:
            break
        time.sleep(0.2)
    report()
    return 0


def _control_store():
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )


# ============================================================================ driver


def _parse_log(raw):
    rows = []
    for item in raw.split(";"):
        if item.strip():
            s, loss, tps, n = item.split()
            rows.append((int(s), float(loss), float(tps), int(n)))
    return rows


def _parse_events(raw):
    out = []
    for item in raw.split(";"):
        if ":" in item:
            kind, s = item.split(":")
            out.append((kind, int(s)))
    return out


def plot(rows, events, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r[0] for r in rows]
    ax.plot(
        steps,
        [r[1] for r in rows],
        lw=1.2,
        color="tab:blue",
        label="training loss (mean over ranks)",
    )
    colors = {"killed": "tab:red", "recovered": "tab:green"}
    for kind, s in events:
        ax.axvline(s, color=colors.get(kind, "gray"), ls="--", lw=1)
        ax.annotate(
            f"rank {kind} @ {s}",
            (s, ax.get_ylim()[1]),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=colors.get(kind, "gray"),
        )
    degraded = [r[0] for r in rows if r[3] < max(x[3] for x in rows)]
    if degraded:
        ax.axvspan(min(degraded), max(degraded), color="tab:red", alpha=0.08, label="fewer ranks")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("MoE LM over mooncake: loss, failure and recovery")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def launcher_argv(args, rest, node_rank) -> list:
    """``mooncake-run``'s arguments for the node (host) ``node_rank`` of ``args.hosts``: its
    ``--nproc / --hosts`` training ranks, and the rollout workers on the last host."""
    import shlex

    script = os.path.abspath(__file__)
    largv = [
        "--nproc-per-node",
        str(args.nproc // args.hosts),
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
    ]
    if args.hosts > 1:
        largv += ["--nnodes", str(args.hosts), "--node-rank", str(node_rank)]
        largv += ["--master-addr", args.master_addr, "--master-port", str(args.master_port)]
    if args.log_dir:
        d = os.path.join(args.log_dir, f"host{node_rank}") if args.hosts > 1 else args.log_dir
        largv += ["--log-dir", d]
    if node_rank == args.hosts - 1:
        for _ in range(args.rollouts):
            largv += [
                "--sidecar",
                shlex.join([sys.executable, "-u", script, "--role", "rollout", *rest]),
            ]
    return [*largv, script, "--role", "train", *rest]


HOSTS_PORT = 29500  # the namespaces and their addresses belong to this run alone


def drive_hosts(args, rest) -> int:
    """``--hosts N``: the same run over N emulated hosts (network namespaces on one bridge,
    each process with its host's hostname, so the backend groups ranks by host): this
    driver again in host 0 (the launcher's control store and the store master there,
    bound to host 0's address), a ``mooncake-run`` node on each other host, the rollout
    workers on the last one. The namespaces are deleted at the end, also on errors."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from tests import netns
    from tests.faults import kill_group

    ok, why = netns.available()
    if not ok:
        print(
            f"[demo] --hosts {args.hosts} emulates hosts with network namespaces, which this "
            f"machine does not allow ({why}); run it as root with iproute2, or without --hosts",
            flush=True,
        )
        return 2
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
    }
    os.makedirs(args.out, exist_ok=True)
    with netns.hosts(args.hosts, "mcdemo") as t:
        args.master_addr, args.master_port = t.addr[t.hosts[0]], HOSTS_PORT
        rest = [*rest, "--master-addr", args.master_addr, "--master-port", str(HOSTS_PORT)]
        if args.rollouts > 0 and not args.store:
            rest += ["--store", f"{args.master_addr}:{HOSTS_PORT + 1}", "--serve-store"]
        print(
            f"[demo] {args.hosts} emulated hosts (network namespaces), "
            f"{args.nproc // args.hosts} training ranks each, "
            f"{args.rollouts} rollout worker(s) on host{args.hosts - 1}; "
            f"other hosts' launchers log to {args.out}/host<i>.log",
            flush=True,
        )
        script = os.path.abspath(__file__)
        driver = netns.run_in(
            t.hosts[0], [sys.executable, script, *rest], env=env, hostname="host0"
        )
        nodes, logs = [], []
        try:
            for i in range(1, args.hosts):
                log = open(os.path.join(args.out, f"host{i}.log"), "w")
                logs.append(log)
                argv = [sys.executable, "-m", "mooncake_pg.run", *launcher_argv(args, rest, i)]
                nodes.append(
                    netns.run_in(
                        t.hosts[i], argv, env=env, hostname=f"host{i}", stdout=log, stderr=log
                    )
                )
            rc = driver.wait()
            failed = []
            for i, p in enumerate(nodes, 1):
                try:
                    if p.wait(timeout=30):
                        failed.append(i)
                except Exception:
                    failed.append(i)
            if failed:
                print(f"[demo] the launcher of host(s) {failed} failed: see their logs", flush=True)
            return rc or int(bool(failed))
        finally:
            for p in [driver, *nodes]:
                kill_group(p)
            for log in logs:
                log.close()


def drive(args, rest) -> int:
    from tqdm import tqdm

    from mooncake_pg import run as mrun

    if args.hosts > 1 and args.master_addr is None:
        return drive_hosts(args, rest)
    embedded = None
    if args.rollouts > 0 and (args.serve_store or not args.store):
        from mooncake_store import MasterConfig, MooncakeStore
        from mooncake_store.common.config import parse_hostport

        # the store master (and a segment for weights and K/V) lives in this process: on
        # 127.0.0.1, or (--hosts) on host 0's address for the other hosts
        master = None
        if args.serve_store:
            host, port = parse_hostport(args.store, "--store")
            master = MasterConfig(host=host, port=port)
        embedded = MooncakeStore(segment_size=args.store_segment_mib << 20, master_config=master)
        args.store = embedded.master_address
    if args.store:
        rest = [*rest, "--store", args.store]
    largv = launcher_argv(args, rest, 0)
    os.makedirs(args.out, exist_ok=True)
    raw, root = read_corpus(args.corpus, args.corpus_bytes)
    print(
        f"[demo] corpus: {len(raw):,} bytes from {root}; {args.nproc} training ranks; "
        f"kill rank {args.kill_rank} at step {args.kill_at}"
        if args.kill_rank >= 0
        else "no kill",
        flush=True,
    )
    bar = tqdm(
        total=args.steps,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout,
        mininterval=0.5 if sys.stdout.isatty() else 5.0,
    )
    state = {"events": 0}

    def tick(launcher):
        st = launcher.store
        if st is None or not st.check(["demo/status"]):
            return
        s = json.loads(st.get("demo/status"))
        if s["step"] != state.get("step"):
            state["step"] = s["step"]
            extra = {}
            if st.check(["demo/published"]):
                extra["published"] = st.get("demo/published").decode()
            if args.rollouts and st.check(["demo/rollout/0"]):
                ro = json.loads(st.get("demo/rollout/0"))
                extra["serving"] = ro["versions"][-1] if ro["versions"] else "-"
                looked = ro["hit_tokens"] + ro["miss_tokens"]
                extra["hit"] = f"{ro['hit_tokens'] / looked:.2f}" if looked else "-"
            bar.set_postfix(
                loss=f"{s['loss']:.3f}",
                tok_s=f"{s['tokens_per_s']:.0f}",
                ranks=s["ranks"],
                recoveries=s["recoveries"],
                **extra,
                refresh=False,
            )
            bar.update(min(s["step"], args.steps) - bar.n)
        if st.check(["demo/events"]):
            ev = _parse_events(st.get("demo/events").decode())
            for kind, s_ in ev[state["events"] :]:
                bar.write(f"[demo] step {s_}: a rank {kind}")
            state["events"] = len(ev)

    t0 = time.monotonic()
    holder = {}

    def tick_keep(launcher):
        holder["launcher"] = launcher
        tick(launcher)
        # keep what the ranks reported before the launcher (and its store) go away
        st = launcher.store
        if st is not None:
            for k in (
                "demo/log",
                "demo/events",
                "demo/final",
                *[f"demo/rollout/{i}" for i in range(args.rollouts)],
            ):
                if st.check([k]):
                    holder[k] = st.get(k).decode()

    try:
        rc = mrun.main(largv, tick=tick_keep)
    finally:
        bar.close()
        if embedded is not None:
            embedded.close()
    wall = time.monotonic() - t0
    rows = _parse_log(holder.get("demo/log", ""))
    events = _parse_events(holder.get("demo/events", ""))
    final = json.loads(holder["demo/final"]) if "demo/final" in holder else {}
    if not rows:
        print("[demo] no training progress was reported", flush=True)
        return 1
    k = max(1, len(rows) // 10)
    first = sum(r[1] for r in rows[:k]) / k
    last = sum(r[1] for r in rows[-k:]) / k
    tps = sorted(r[2] for r in rows)[len(rows) // 2]
    png = os.path.join(args.out, "loss.png")
    plot(rows, events, png)
    killed = [s for kind, s in events if kind == "killed"]
    recovered = [s for kind, s in events if kind == "recovered"]
    rollouts = [json.loads(holder[k]) for k in sorted(holder) if k.startswith("demo/rollout/")]
    hits = sum(r["hit_tokens"] for r in rollouts)
    looked = hits + sum(r["miss_tokens"] for r in rollouts)
    causes: dict = {}
    for r in rollouts:
        for cause, n in r["miss_causes"].items():
            causes[cause] = causes.get(cause, 0) + n
    versions = rollouts[0]["versions"] if rollouts else []
    checks = {
        "launcher exit 0": rc == 0,
        "loss went down": last < first,
        "failure recovered": (len(recovered) >= len(killed)) if args.kill_rank >= 0 else True,
        "all ranks at the end": bool(final) and all(final["active"]),
        "dense parameters equal": bool(final.get("dense_equal")),
    }
    if args.rollouts:
        checks["rollouts served >= 2 increasing versions"] = all(
            len(r["versions"]) >= 2 and r["versions"] == sorted(set(r["versions"]))
            for r in rollouts
        ) and bool(rollouts)
        checks["rollout cache hit rate > 0"] = hits > 0
        checks["logits equal with K/V reuse"] = all(r["max_logits_diff"] < 1e-4 for r in rollouts)
        checks["no K/V of another weight version served"] = all(
            r["wrong_version"] == 0 for r in rollouts
        )
    summary = [
        ("steps", f"{final.get('steps', rows[-1][0])}"),
        ("wall time", f"{wall:.1f} s"),
        ("loss (first / last 10%)", f"{first:.3f} -> {last:.3f}"),
        ("median tokens/s (all ranks)", f"{tps:,.0f}"),
        ("killed at step", ", ".join(map(str, killed)) or "-"),
        ("recovered at step", ", ".join(map(str, recovered)) or "-"),
        ("membership epoch at the end", f"{final.get('epoch', '?')}"),
        ("versions served by rollout 0", ", ".join(map(str, versions)) or "-"),
        (
            "rollout K/V token hit rate",
            f"{hits / looked:.2f} ({hits} of {looked} tokens)" if looked else "-",
        ),
        (
            "rollout miss causes (explain)",
            ", ".join(f"{c}: {n}" for c, n in sorted(causes.items(), key=lambda x: -x[1])) or "-",
        ),
        ("rollout sample (latest version)", repr(rollouts[0]["sample"][:40]) if rollouts else "-"),
        ("loss plot", png),
    ] + [(name, "ok" if ok else "FAILED") for name, ok in checks.items()]
    width = max(len(a) for a, _ in summary)
    print("\n" + "-" * (width + 40))
    for a, b in summary:
        print(f"{a:<{width}}  {b}")
    print("-" * (width + 40), flush=True)
    return 0 if all(checks.values()) else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small MoE LM with EP over mooncake; survive a killed rank."
    )
    p.add_argument("--role", choices=["driver", "train", "rollout"], default="driver")
    p.add_argument("--nproc", type=int, default=4, help="training ranks (default 4)")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        help="rank that SIGKILLs itself (-1: none; default 1, with --hosts the first rank of "
        "the last host)",
    )
    p.add_argument("--kill-at", type=int, default=None, help="its step (default: the middle)")
    p.add_argument(
        "--corpus", default=None, help="text file or directory (default: Python's stdlib source)"
    )
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--experts", type=int, default=8, help="experts per MoE layer (a multiple of --nproc)"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--snapshot-every", type=int, default=10, help="steps between expert snapshots")
    p.add_argument("--op-timeout", type=float, default=30.0)
    p.add_argument("--rejoin-timeout", type=float, default=120.0)
    p.add_argument(
        "--store",
        default=None,
        help="store master HOST:PORT (default: one in the launcher process)",
    )
    p.add_argument(
        "--store-segment-mib", type=int, default=256, help="the launcher's store segment, MiB"
    )
    p.add_argument(
        "--publish-every", type=int, default=20, help="steps between published weight versions"
    )
    p.add_argument("--rollouts", type=int, default=1, help="rollout worker processes (0: none)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per version (sharing a prefix)")
    p.add_argument(
        "--prompt-prefix", type=int, default=64, help="tokens of the shared prompt prefix"
    )
    p.add_argument("--chunk-tokens", type=int, default=16, help="K/V chunk size of the cache")
    p.add_argument("--gen-tokens", type=int, default=24, help="tokens generated per prompt")
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="spread the training ranks (and put the rollout workers on the last) over this "
        "many emulated hosts: network namespaces joined by a bridge (root, iproute2)",
    )
    p.add_argument("--master-addr", default=None, help=argparse.SUPPRESS)  # --hosts: host 0's
    p.add_argument("--master-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve-store", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="demo_out", help="directory for the loss plot")
    p.add_argument("--log-dir", default=None, help="per-rank logs (default: this terminal)")
    args = p.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = args.steps // 2
    if args.hosts < 1:
        p.error(f"--hosts must be at least 1, got {args.hosts}")
    if args.nproc % args.hosts:
        p.error(f"--nproc ({args.nproc}) must be a multiple of --hosts ({args.hosts})")
    if args.kill_rank is None:
        args.kill_rank = args.nproc - args.nproc // args.hosts if args.hosts > 1 else 1
    if args.experts % args.nproc:
        p.error(f"--experts ({args.experts}) must be a multiple of --nproc ({args.nproc})")
    if args.kill_rank >= args.nproc:
        p.error(f"--kill-rank must be < --nproc ({args.nproc}) or -1")
    if args.kill_rank >= 0 and not 0 <= args.kill_at < args.steps:
        p.error(f"--kill-at must be a step in [0, --steps ({args.steps})), got {args.kill_at}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.role == "train":
        return train(args)
    if args.role == "rollout":
        return rollout(args)
    rest = [a for a in argv if a not in ("--role", "driver")]
    if args.kill_at is not None and "--kill-at" not in rest:
        rest += ["--kill-at", str(args.kill_at)]
    return drive(args, rest)


if __name__ == "__main__":
    sys.exit(main())
