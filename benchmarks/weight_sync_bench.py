"""Weight sync: one trainer to three rollout processes, three ways, in one run.

A bf16 state dict (``--mib``, 1024 by default, in tensors of ``--tensor-mib``) goes from
rank 0 (the trainer) to ranks 1-3 (rollout workers):

* ``store-view``: ``WeightSync.publish`` on the trainer (which contributes the segment),
  then ``WeightSync.pull`` into the rollout models on the three workers at once with
  ``WeightSyncConfig(install="view")``: same host, so the workers' parameters become
  read-only views of the published bytes (the trainer's copy into its segment is the only
  copy; one copy of the weights on the host however many workers);
* ``store-copy``: the same with ``install="copy"`` (the default): each worker stages the
  version from the mapped segment and copies it into its own parameters;
* ``pg``: ``GroupWeightSync.sync`` over the ``mooncake`` process group (buckets of
  ``--bucket-mib``, staged, installed when every rank staged every bucket);
* ``gloo``: ``torch.distributed.broadcast`` of every tensor over a gloo group.

Per-tensor XXH3 checksums (written by the trainer, verified by every worker before it
installs) are off unless ``--checksums`` is given. Each way runs ``--reps`` times; a rep is timed on the trainer from a barrier before the
first byte to a barrier after every worker installed the version (the end-to-end time
of one weight update); the medians are reported as seconds and GB/s (state bytes over
that time). Workers check after the last rep that they hold the trainer's tensors.
Processes: 4 ranks started by this script, each in its own session, killed as groups at
exit; a store master on 127.0.0.1; one torch thread per rank.

    .venv/bin/python benchmarks/weight_sync_bench.py               # 1 GiB, 3 reps
    .venv/bin/python benchmarks/weight_sync_bench.py --smoke       # 64 MiB, 1 rep (CI)
    .venv/bin/python benchmarks/weight_sync_bench.py --markdown out.md --gate

Across hosts (``--hosts 1+2+2+2``: the trainer, rank 0, alone on host 0 and three rollout
hosts of two readers, network namespaces whose links ``tc`` limits to ``--link-rate``,
tests/netns.py): four ways (``--ways``, a comma list, picks some), each timed the same way,
against the link bound (the state's bytes over one host link: the least time in which the
trainer's host can send them once) and with the bytes that left the trainer's host per
version (kernel counters):

* ``store-relay``: ``WeightSync.publish`` on the trainer, then ``pull`` on every reader at
  once with ``WeightSyncConfig(relay=True)``: the readers of a host share one pull (its
  relay keeps a copy in its segment, which the host's other readers map) and the hosts
  pass the buckets along a chain, so the trainer's link carries each byte about once;
* ``store-direct``: the same with ``relay=False``: every reader reads every bucket from
  the trainer's segment, one copy per reader over the trainer's link;
* ``pg`` and ``gloo`` as above.

The store master runs in rank 0 on host 0's address; every rank has a client (the
trainer's segment holds the store ways' versions, a reader's two relayed versions).

    .venv/bin/python benchmarks/weight_sync_bench.py --hosts 1+2+2+2 --mib 256 --tensor-mib 16 --bucket-mib 16

Gate (``--gate`` exits 1 when it fails): the store path (``store-view``, the fastest
store configuration for rollout workers on the trainer's host) at least 3x faster than
the gloo broadcast.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
WORLD = 4
WAYS = ("store-view", "store-copy", "pg", "gloo")
_children: list = []


def _kill_children():
    sys.path.insert(0, REPO)
    from tests.faults import kill_group

    for p in _children:
        kill_group(p)


def _model(mib, tensor_mib, seed):
    """A module whose parameters are ``mib // tensor_mib`` bf16 tensors of ``tensor_mib``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, mib // tensor_mib)
    m = torch.nn.Module()
    for i in range(n):
        w = torch.randn(tensor_mib * MiB // 2, generator=g, dtype=torch.float32).to(torch.bfloat16)
        m.register_parameter(f"w{i}", torch.nn.Parameter(w, requires_grad=False))
    return m


def _worker(a):
    import torch

    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    import mooncake_pg
    from mooncake_store import (
        GroupWeightSync,
        MooncakeStore,
        WeightSync,
        WeightSyncConfig,
        tensor_digest,
    )

    rank = a.rank
    dist.init_process_group(
        "mooncake",
        init_method="file://" + a.rdzv,
        rank=rank,
        world_size=WORLD,
        pg_options=mooncake_pg.MooncakeOptions(timeout=300.0),
        timeout=timedelta(seconds=300),
    )
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    bucket = a.bucket_mib * MiB
    # docs/weight-sync.md "Sizing the trainer's segment": keep_versions + 2 versions per
    # model (the copy way's), one more for the view way (its readers' held version stays
    # until that model's next commit), plus 10 %
    seg = (a.mib * 5 * 11 // 10 + 64) * MiB if rank == 0 else 0
    store = MooncakeStore(master=a.master, segment_size=seg, serve_tcp=False)
    ws = {
        way: WeightSync(
            store,
            "bench-" + way,
            config=WeightSyncConfig(
                bucket_bytes=bucket,
                keep_versions=0,
                checksums=a.checksums,
                install=way.split("-")[1],
            ),
        )
        for way in ("store-view", "store-copy")
    }
    gs = GroupWeightSync(src=0, bucket_bytes=bucket)
    model = _model(a.mib, a.tensor_mib, 0)  # the trainer's weights
    # the workers' models, starting at zero: one for the view path (its parameters become
    # read-only views), one shared by the other ways
    models = dict.fromkeys(WAYS, model)
    if rank > 0:
        plain = _model(a.mib, a.tensor_mib, 1)
        models = {
            way: _model(a.mib, a.tensor_mib, 1) if way == "store-view" else plain for way in WAYS
        }
        with torch.no_grad():
            for m in {id(m): m for m in models.values()}.values():
                for t in m.parameters():
                    t.zero_()
    times: dict = {way: [] for way in WAYS}
    version = 0
    for rep in range(a.reps):
        if rank == 0:
            with torch.no_grad():
                for t in model.parameters():  # a new version each rep
                    t.view(-1)[rep] += 1
        for way in WAYS:
            version += 1
            m = models[way]
            dist.barrier()
            t0 = time.perf_counter()
            if way.startswith("store"):
                if rank == 0:
                    ws[way].publish(m, version)
                dist.barrier(group=gloo)
                if rank > 0:
                    ws[way].pull(m, version=version)
            elif way == "pg":
                gs.sync(m, version if rank == 0 else None)
            else:
                for t in m.parameters():
                    dist.broadcast(t.data, src=0, group=gloo)
            dist.barrier()
            times[way].append(time.perf_counter() - t0)
    digests = {
        way: {k: tensor_digest(v) for k, v in m.state_dict().items()} for way, m in models.items()
    }
    out = {"rank": rank, "times": times, "digests": digests}
    with open(os.path.join(a.outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    store.close()
    dist.destroy_process_group()


def _report(a, lines: list, payload: dict) -> None:
    """The table to stdout, and to --markdown / --json when given."""
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(payload, f)


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


HOST_WAYS = ("store-relay", "store-direct", "pg", "gloo")
# the store ways' models: one per way, so that their versions do not mix
_STORE_MODELS = {"store-relay": "relay", "store-direct": "direct"}


def _hosts_worker() -> None:
    """One rank of the ``--hosts`` run (started by tests.multihost.run_ranks: MH_* set)."""
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import mooncake_pg
    from mooncake_store import GroupWeightSync, tensor_digest

    a = json.loads(os.environ["MH_ARGS"])
    ways = a["ways"]
    rank, world = int(os.environ["MH_RANK"]), int(os.environ["MH_WORLD_SIZE"])
    timeout = timedelta(seconds=300)
    bucket = a["bucket_mib"] * MiB
    # the default group (gloo) is the control plane: barriers and the gloo way
    dist.init_process_group(
        "gloo", init_method=os.environ["MH_INIT"], rank=rank, world_size=world, timeout=timeout
    )
    mc = dist.new_group(
        backend="mooncake",
        pg_options=mooncake_pg.MooncakeOptions(timeout=300.0),
        timeout=timeout,
    )
    store_ways = [w for w in ways if w in _STORE_MODELS]
    master = store = None
    ws: dict = {}
    if store_ways:
        from mooncake_store import Master, MasterConfig, MooncakeStore, WeightSync, WeightSyncConfig

        # the store master: in rank 0, on host 0's address (the rendezvous' host), another port
        from tests.multihost import store_master_address

        host0, mport = store_master_address()
        if rank == 0:
            master = Master(MasterConfig(host=host0, port=mport)).start()
    dist.barrier()  # the master is up
    if store_ways:
        # a reader's segment: four versions, as docs/weight-sync.md sizes it (a relay's
        # copies of the version it relays, and those of the versions published within the
        # master's lease_ttl_s before it, kept until the read leases on them end: reps come
        # about 2 s apart; a relay without room steps down, and the hosts after it read
        # from the one before). The trainer's: per
        # store way keep_versions + 2 = 2 versions, one for the space of a dropped version
        # until its read leases end and one against fragmentation (docs/weight-sync.md
        # "Sizing the trainer's segment"); a publisher's pieces go to its own segment
        model_mib = max(1, a["mib"] // a["tensor_mib"]) * a["tensor_mib"]  # as _model makes it
        reader_seg = (4 * model_mib + 64) * MiB
        seg = (4 * len(store_ways) * model_mib + 64) * MiB
        seg = seg if rank == 0 else reader_seg
        store = MooncakeStore(master=f"{host0}:{mport}", segment_size=seg)
        ws = {
            way: WeightSync(
                store,
                "bench-" + _STORE_MODELS[way],
                config=WeightSyncConfig(
                    relay=way == "store-relay",
                    pin=True,
                    bucket_bytes=bucket,
                    keep_versions=0,
                    relay_part_bytes=a["part_mib"] * MiB,
                    install=a["install"],
                ),
            )
            for way in store_ways
        }
    gs = GroupWeightSync(group=mc, src=0, bucket_bytes=bucket) if "pg" in ways else None
    model = _model(a["mib"], a["tensor_mib"], 0 if rank == 0 else 1)
    if rank > 0:
        with torch.no_grad():
            for t in model.parameters():
                t.zero_()
    times: dict = {way: [] for way in ways}
    tx: dict = {way: [] for way in ways}
    relay: dict = {way: [] for way in store_ways}  # PullResult.relay_position per rep
    publish_s: dict = {way: [] for way in store_ways}  # the trainer's publish alone
    # from the version's start to the end of this reader's pull
    pull_end_s: dict = {way: [] for way in store_ways}
    timeline: list = []  # store-relay, last rep: this reader's pull, phase by phase
    pull_s: dict = {way: [] for way in store_ways}  # this reader's pull alone
    digests = {}
    version = 0
    for rep in range(a["reps"]):
        for way in ways:
            version += 1
            if rank == 0:
                with torch.no_grad():
                    for t in model.parameters():  # a new version each time
                        t.view(-1)[rep] += 1
            dist.barrier()
            tx0 = _tx_bytes()
            t0 = time.perf_counter()
            if way in ws:
                if rank == 0:
                    ws[way].publish(model, version)
                    publish_s[way].append(time.perf_counter() - t0)
                dist.barrier()  # published: every reader pulls at once
                if rank > 0:
                    # --stagger-ms: the readers of rollout host h start h - 1 staggers late
                    time.sleep(a.get("stagger_ms", 0) / 1e3 * (a["host_of"][rank] - 1))
                    t1 = time.perf_counter()
                    pr = ws[way].pull(into=model, version=version)
                    relay[way].append(pr.relay_position)
                    pull_end_s[way].append(time.perf_counter() - t0)
                    pull_s[way].append(time.perf_counter() - t1)
                    if way == "store-relay" and rep == a["reps"] - 1 and a.get("verbose"):
                        from mooncake_store.weight_sync.timeline import format_timeline

                        timeline = format_timeline(pr.timeline, ws[way].puller.timeline.requests)
            elif way == "pg":
                gs.sync(model, version if rank == 0 else None)
            else:
                for t in model.parameters():
                    dist.broadcast(t.data, src=0)
            dist.barrier()
            times[way].append(time.perf_counter() - t0)
            tx[way].append(_tx_bytes() - tx0)
            if rep == a["reps"] - 1:  # what this way's last version left in the model
                digests[way] = {k: tensor_digest(v) for k, v in model.state_dict().items()}
    res = {
        "times": times,
        "tx": tx,
        "digests": digests,
        "relay": relay,
        "publish_s": publish_s,
        "pull_end_s": pull_end_s,
        "timeline": timeline,
        "pull_s": pull_s,
    }
    print("RESULT " + json.dumps(res), flush=True)
    if store is not None:
        store.close()
    dist.barrier()  # every client closed before the master goes
    if master is not None:
        master.stop()
    dist.destroy_process_group()
    os._exit(0)


def _run_hosts(a) -> int:
    """The ``--hosts`` run: launch, collect, print the table."""
    sys.path.insert(0, REPO)  # the test helpers' package (tests.netns, tests.multihost)
    from multihost_bench import parse_rate, parse_topology

    from tests import netns
    from tests.multihost import rank_hosts, run_bench

    ok, why = netns.available()
    if not ok:
        print(f"weight_sync_bench --hosts: skipped: network namespaces: {why}")
        return 0
    rph = parse_topology(a.hosts)
    rate_bit = parse_rate(a.link_rate)
    ways = a.ways
    plan = {
        "mib": a.mib,
        "tensor_mib": a.tensor_mib,
        "bucket_mib": a.bucket_mib,
        "reps": a.reps,
        "ways": ways,
        "verbose": a.verbose,
        "part_mib": a.part_mib,
        "stagger_ms": a.stagger_ms,
        "install": a.install,
        "host_of": rank_hosts(rph),
    }
    load0 = os.getloadavg()[0]
    argv = [sys.executable, os.path.abspath(__file__), "--hosts-worker"]
    res = run_bench(rph, argv, plan, prefix="mcwsb", rate_bit=rate_bit, timeout_s=a.timeout)
    bad = {r: v for r, v in res.items() if "times" not in v}
    if bad:
        for r, v in bad.items():
            print(f"--- rank {r}: {v.get('error')}\n{v.get('log', '')[-3000:]}", file=sys.stderr)
        return 1
    world = sum(rph)
    ok_bytes = all(
        res[r]["digests"][way] == res[0]["digests"][way] for r in range(1, world) for way in ways
    )
    nbytes = max(1, a.mib // a.tensor_mib) * a.tensor_mib * MiB
    bound_s = nbytes / (rate_bit / 8)
    rows = {}
    for way in ways:
        # a version's time: the slowest rank's, between the barriers around it
        per = [max(res[r]["times"][way][i] for r in range(world)) for i in range(a.reps)]
        s = statistics.median(per)
        rows[way] = {
            "s": s,
            "gbs": nbytes / s / 1e9,
            "bound_pct": 100 * bound_s / s,
            "mb_out_trainer_host": statistics.median(res[0]["tx"][way]) / 1e6,
        }
    names = {
        "store-relay": "store (`WeightSync` publish + pull, `relay=True`)",
        "store-direct": "store (`WeightSync` publish + pull, `relay=False`)",
        "pg": "process group (`GroupWeightSync`, mooncake)",
        "gloo": "`torch.distributed.broadcast` over gloo",
    }
    lines = [
        f"1 trainer host (1 rank) -> {len(rph) - 1} rollout hosts ({'+'.join(map(str, rph[1:]))} "
        f"readers), {nbytes / MiB:.0f} MiB bf16 in {a.tensor_mib} MiB tensors, buckets "
        f"{a.bucket_mib} MiB, relay parts {a.part_mib} MiB, install {a.install}, links {rate_bit / 1e9:g} Gbit/s, median of {a.reps}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load {load0:.1f} before",
        "",
        "| path | seconds | GB/s | vs gloo | link bound s | % of bound | MB out of the trainer's host |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, r in rows.items():
        vs = f"{rows['gloo']['s'] / r['s']:.2f}x" if "gloo" in rows else "-"
        lines.append(
            f"| {names[way]} | {r['s']:.3f} | {r['gbs']:.3f} | {vs} "
            f"| {bound_s:.3f} | {r['bound_pct']:.0f}% | {r['mb_out_trainer_host']:.1f} |"
        )
    lines += ["", f"readers hold the trainer's tensors (digests): {ok_bytes}"]
    for way in ways:
        if res[0].get("publish_s", {}).get(way):
            lines.append(
                f"{way}: of which the trainer's publish {statistics.median(res[0]['publish_s'][way]):.3f} s"
            )
    relays = {}  # store-relay: the readers that relayed the last version, by chain position
    if "store-relay" in ways:
        hosts = rank_hosts(rph)
        relays = {
            r: res[r]["relay"]["store-relay"][-1]
            for r in range(1, world)
            if res[r]["relay"]["store-relay"][-1] is not None
        }
        chain = ", ".join(
            f"{p}: host {hosts[r]} (rank {r})"
            for r, p in sorted(relays.items(), key=lambda kv: kv[1])
        )
        lines.append(
            f"store-relay, last version: {len(relays)} of {world - 1} readers relayed"
            + (f" (chain position: host) {chain}" if chain else "")
        )
        # where a version's time goes along the chain: each position's pull ends (the relay's
        # and its host's other readers', the latest of them) after the version started
        ends: dict = {}  # position -> rep -> seconds
        for i in range(a.reps):
            got = [(hosts[r], res[r]["relay"]["store-relay"][i]) for r in range(1, world)]
            pos = {h: p for h, p in got if p is not None}  # host -> its relay's position
            for r in range(1, world):
                if hosts[r] in pos:
                    per = ends.setdefault(pos[hosts[r]], {})
                    per[i] = max(per.get(i, 0.0), res[r]["pull_end_s"]["store-relay"][i])
        slowest = [
            max(res[r]["pull_s"]["store-relay"][i] for r in range(1, world)) for i in range(a.reps)
        ]
        lines.append(
            f"store-relay, slowest reader's pull alone (median over reps): "
            f"{statistics.median(slowest):.3f} s, {statistics.median(slowest) / bound_s:.2f}x "
            f"one link-time"
            + (
                f" (host h readers start {a.stagger_ms:g} ms x (h - 1) late)"
                if a.stagger_ms
                else ""
            )
        )
        rows["store-relay"]["slowest_pull_s"] = statistics.median(slowest)
        if ends:
            lines.append(
                "store-relay, median time to the end of the pulls of each chain position's host: "
                + ", ".join(
                    f"{p}: {statistics.median(ends[p].values()):.3f} s" for p in sorted(ends)
                )
            )
    if a.verbose and "store-relay" in ways:
        for r in range(1, world):
            if res[r].get("timeline"):
                pos = res[r]["relay"]["store-relay"][-1]
                print(f"--- rank {r} (host {hosts[r]}, chain position {pos}), last version's pull:")
                print("\n".join(res[r]["timeline"]))
    _report(
        a,
        lines,
        {
            "rows": rows,
            "bytes": nbytes,
            "bound_s": bound_s,
            "bytes_ok": ok_bytes,
            "relay_positions": relays,
        },
    )
    return 0 if ok_bytes else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--mib", type=int, default=1024, help="state dict size in MiB (bf16)")
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="64 MiB, 1 rep")
    ap.add_argument(
        "--checksums", action="store_true", help="store paths with per-tensor XXH3 digests"
    )
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument(
        "--hosts",
        default=None,
        help="ranks per emulated host, trainer's host first, e.g. 1+2+2+2",
    )
    ap.add_argument(
        "--ways",
        default=",".join(HOST_WAYS),
        help=f"with --hosts: the ways to time, a comma list of {', '.join(HOST_WAYS)} (default all)",
    )
    ap.add_argument(
        "--link-rate", default="2G", help="with --hosts: each host link's rate (bit/s; K/M/G)"
    )
    ap.add_argument(
        "--part-mib",
        type=int,
        default=4,
        help="with --hosts: WeightSyncConfig.relay_part_bytes in MiB (default 4, the config's)",
    )
    ap.add_argument(
        "--install",
        default="copy",
        choices=("copy", "swap"),
        help="with --hosts: the readers' WeightSyncConfig.install (default copy)",
    )
    ap.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="with --hosts: the readers of rollout host h start their pulls (h - 1) x this late",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="with --hosts: print each reader's last store-relay pull, phase by phase",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hosts-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--rdzv", default="", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--outdir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:
        a.mib, a.tensor_mib, a.bucket_mib, a.reps = 64, 8, 16, 1
    if a.worker:
        _worker(a)
        return 0
    if a.hosts_worker:
        _hosts_worker()
        return 0
    if a.hosts:
        a.ways = [w for w in a.ways.split(",") if w]
        unknown = sorted(set(a.ways) - set(HOST_WAYS))
        if unknown or not a.ways or len(set(a.ways)) != len(a.ways):
            ap.error(f"--ways: a comma list of distinct ways from {', '.join(HOST_WAYS)}")
        if a.gate:
            ap.error("--gate applies to the single-host run, not --hosts")
        return _run_hosts(a)
    atexit.register(_kill_children)
    tmp = tempfile.mkdtemp(prefix="ws-bench-")
    port_file = os.path.join(tmp, "port")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(tmp, "master.log"), "w")
    _children.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_store.master",
                "--port",
                "0",
                "--port-file",
                port_file,
            ],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if time.monotonic() > deadline:
            print("master did not start", file=sys.stderr)
            return 1
        time.sleep(0.05)
    master = "127.0.0.1:" + open(port_file).read().split()[0]
    ranks = []
    for r in range(WORLD):
        lf = open(os.path.join(tmp, f"rank{r}.log"), "w")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--rank",
            str(r),
            "--rdzv",
            os.path.join(tmp, "rdzv"),
            "--master",
            master,
            "--outdir",
            tmp,
            "--mib",
            str(a.mib),
            "--tensor-mib",
            str(a.tensor_mib),
            "--bucket-mib",
            str(a.bucket_mib),
            "--reps",
            str(a.reps),
        ]
        if a.checksums:
            cmd.append("--checksums")
        p = subprocess.Popen(cmd, stdout=lf, stderr=lf, env=env, start_new_session=True)
        _children.append(p)
        ranks.append(p)
    deadline = time.monotonic() + a.timeout
    while any(p.poll() is None for p in ranks):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in ranks):
            _kill_children()
            for r in range(WORLD):
                print(
                    f"--- rank {r} log ---\n"
                    + open(os.path.join(tmp, f"rank{r}.log")).read()[-3000:],
                    file=sys.stderr,
                )
            print("a rank failed or timed out", file=sys.stderr)
            return 1
        time.sleep(0.1)
    res = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    ok_bytes = all(r["digests"][way] == res[0]["digests"][way] for r in res[1:] for way in WAYS)
    nbytes = max(1, a.mib // a.tensor_mib) * a.tensor_mib * MiB
    rows = {}
    for way in WAYS:
        s = statistics.median(res[0]["times"][way])
        rows[way] = (s, nbytes / s / 1e9)
    speed = rows["gloo"][0] / rows["store-view"][0]
    lines = [
        f"1 trainer -> 3 rollout processes, {nbytes / MiB:.0f} MiB bf16 in {a.tensor_mib} MiB tensors, "
        f"buckets {a.bucket_mib} MiB, median of {a.reps}, store checksums {'on' if a.checksums else 'off'}",
        "",
        "| path | seconds | GB/s | vs gloo broadcast |",
        "|---|---|---|---|",
    ]
    names = {
        "store-view": "store (`WeightSync` publish + pull, `install=\"view\"`)",
        "store-copy": "store (`WeightSync` publish + pull, `install=\"copy\"`)",
        "pg": "process group (`GroupWeightSync`, mooncake)",
        "gloo": "`torch.distributed.broadcast` over gloo",
    }
    for way, (s, gbs) in rows.items():
        lines.append(f"| {names[way]} | {s:.3f} | {gbs:.2f} | {rows['gloo'][0] / s:.2f}x |")
    lines += [
        "",
        f"workers hold the trainer's tensors (digests): {ok_bytes}",
        f"gate: store path (view install) >= 3x gloo broadcast: {'PASS' if speed >= 3 else 'FAIL'} ({speed:.2f}x)",
    ]
    _report(
        a, lines, {"rows": rows, "bytes": nbytes, "speedup_vs_gloo": speed, "bytes_ok": ok_bytes}
    )
    _kill_children()
    shutil.rmtree(tmp, ignore_errors=True)
    if not ok_bytes:
        return 1
    return 1 if a.gate and speed < 3 else 0


if __name__ == "__main__":
    raise SystemExit(main())
