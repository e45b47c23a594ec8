#!/usr/bin/env python3
"""Collective benchmark of torch.distributed backends on one host (nccl-tests style).

Measures all_reduce, all_gather_single, reduce_scatter_single, all_to_all_single and
broadcast over a range of sizes and world sizes, for several backends in the same run
(default: mooncake and gloo), with one torch thread per rank, and compares them with
each other and with a shared-memory copy ceiling measured in the same run.

    python benchmarks/pg_bench.py                       # full run, a few minutes on 2 cores
    python benchmarks/pg_bench.py --smoke               # CI: 3 small sizes, about 10 s
    python benchmarks/pg_bench.py --backends gloo --world-sizes 2 --sizes 8,1M,64M
    python benchmarks/pg_bench.py --gate                # also check the speed gates (docs/design.md)

Method. For every world size one set of rank processes runs all the backends (with
--isolate, a fresh set per backend); each rank is in its own session and the set is killed
as a group on exit (and dies with this process). They rendezvous on a TCPStore this process
hosts on a free port of 127.0.0.1. The default process group is gloo and is only the
control plane (barriers, agreeing on iteration counts, collecting times); each backend
under test has its own group over all ranks. For every (op, size) and backend: one checked
call (outputs compared exactly with the expected values), warm-up calls, then N timed calls,
N adapting to the size (about --budget seconds, between --min-iters and --max-iters). The
timed calls run in rounds: in each round every backend runs one block of at most --block
calls after a barrier, the order rotating, so the backends alternate and a slow phase of
the machine hits them alike. Each rank times every call; the time of a call is the maximum
over ranks, the reported time the median over calls. Columns follow nccl-tests: size is the
bytes of the largest buffer (all_gather: output, reduce_scatter: input; the element count
is rounded down to a multiple of the world size where the op splits it), algbw = size /
time, busbw = algbw times 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter,
all_to_all) or 1 (broadcast). float32 throughout, one torch thread per rank. CPU(us) is
the user + system time of every rank process (all its threads, ``time.process_time``)
per timed call, summed over the ranks (each rank's CPU over a block divided by its
calls; median over blocks): waiting that spins shows here and not in the time. "CPU
ratio" is a backend's over gloo's.

The copy ceiling: two processes, one thread each, move the bytes from one's private buffer
to the other's through a ring of shared-memory slots (copy in, copy out, pipelined in
256 KiB chunks, numpy.copyto); ceiling = size / median time of a transfer, measured in the
same run at the same sizes. "%ceil" is busbw as a percentage of the ceiling.

Output: tables on stdout (one per world size), JSON (--json, default bench_out/pg_bench.json)
and the same tables in markdown beside it (.md). A warning is printed when other processes
used the CPUs during the run: numbers from a busy machine mean little.

Exit status: 0 when every launch finished and every checked result was right (slower
numbers never fail the run); 1 otherwise; with --gate-strict also 1 when a gate fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

OPS = ["all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "broadcast"]
BUS_FACTOR = {  # nccl-tests' busbw factors
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_single": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
DEFAULT_SIZES = "8,64,256,1K,4K,16K,64K,256K,1M,4M,16M,64M"
SMOKE_SIZES = "8,4K,256K"
ELEM = 4  # float32
SMALL = 64 * 1024  # below this, also report the latency ratio
README_SIZES = [8, 64 * 1024, 1 << 20, 16 << 20, 64 << 20]  # rows of the markdown summary
MiB = 1 << 20


# ----------------------------------------------------------------------------- helpers


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def counts_for(op: str, size: int, world: int) -> int:
    """Total element count of the largest buffer (nccl-tests rounds down to a multiple of n)."""
    count = max(1, size // ELEM)
    if op in ("all_gather_single", "reduce_scatter_single", "all_to_all_single"):
        count = max(world, count // world * world)
    return count


def iters_for(t_warm: float, args) -> int:
    if t_warm <= 0:
        return args.max_iters
    return int(min(args.max_iters, max(args.min_iters, args.budget / t_warm)))


def parse_backend(spec: str):
    """'mooncake', 'mooncake:tcp' or 'gloo' -> (label, backend, transport)."""
    name, _, transport = spec.partition(":")
    return spec, name, (transport or None)


# ----------------------------------------------------------------------- copy ceiling
#
# Two processes, single-threaded each, move `size` bytes from the writer's private buffer
# to the reader's private buffer through a ring of CEIL_SLOTS shared-memory slots of
# CEIL_CHUNK bytes (an anonymous MAP_SHARED mapping): the writer copies chunk i into a slot
# while the reader copies chunk i-1 out (numpy.copyto), and they hand slots over with
# counters they spin on. The time of one transfer runs from the writer's first copy to its
# seeing the reader's last one. This is what a shared-memory transport with one copy-in and
# one copy-out per byte gets at best on this machine.

CEIL_CHUNK = 256 * 1024
CEIL_SLOTS = 4
_XFER, _SIZE, _PROD, _CONS = 0, 8, 16, 24  # int64 counters, one cache line apart


def _set_pdeathsig():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _ceiling_reader(shm, max_size):
    import numpy as np

    _set_pdeathsig()
    ctl = np.frombuffer(shm, dtype=np.int64, count=32)
    ring = np.frombuffer(shm, dtype=np.uint8, count=CEIL_SLOTS * CEIL_CHUNK, offset=256)
    dst = np.zeros(max_size, dtype=np.uint8)
    seen, g = 0, 0
    while True:
        spin = 0
        while ctl[_XFER] == seen:
            spin += 1
            if spin > 20000:  # idle between sizes, or the machine is oversubscribed
                os.sched_yield()
        seen = int(ctl[_XFER])
        if seen < 0:
            return
        n = int(ctl[_SIZE])
        for off in range(0, n, CEIL_CHUNK):
            k = min(CEIL_CHUNK, n - off)
            spin = 0
            while ctl[_PROD] <= g:
                spin += 1
                if spin > 20000:
                    os.sched_yield()
            slot = (g % CEIL_SLOTS) * CEIL_CHUNK
            np.copyto(dst[off : off + k], ring[slot : slot + k])
            g += 1
            ctl[_CONS] = g


def measure_ceiling(sizes, args):
    """Median time of a pipelined two-process copy through shared memory, per size."""
    import mmap
    import multiprocessing as mp

    import numpy as np

    max_size = max(sizes)
    shm = mmap.mmap(-1, 256 + CEIL_SLOTS * CEIL_CHUNK, flags=mmap.MAP_SHARED)
    ctx = mp.get_context("fork")  # torch is not imported in this process yet
    proc = ctx.Process(target=_ceiling_reader, args=(shm, max_size), daemon=True)
    proc.start()
    ctl = np.frombuffer(shm, dtype=np.int64, count=32)
    ring = np.frombuffer(shm, dtype=np.uint8, count=CEIL_SLOTS * CEIL_CHUNK, offset=256)
    src = np.random.default_rng(0).integers(0, 255, max_size, dtype=np.uint8)
    out, xfer, g = [], 0, 0
    try:
        for n in sizes:
            times = []
            iters = None
            while iters is None or len(times) < iters:
                t0 = time.perf_counter_ns()
                ctl[_SIZE] = n
                xfer += 1
                ctl[_XFER] = xfer
                for off in range(0, n, CEIL_CHUNK):
                    k = min(CEIL_CHUNK, n - off)
                    spin = 0
                    while g - ctl[_CONS] >= CEIL_SLOTS:
                        spin += 1
                        if spin > 20000:
                            os.sched_yield()
                    slot = (g % CEIL_SLOTS) * CEIL_CHUNK
                    np.copyto(ring[slot : slot + k], src[off : off + k])
                    g += 1
                    ctl[_PROD] = g
                spin = 0
                while ctl[_CONS] < g:
                    spin += 1
                    if spin > 20000:
                        os.sched_yield()
                        if not proc.is_alive():
                            raise RuntimeError("copy ceiling: the reader process died")
                times.append((time.perf_counter_ns() - t0) * 1e-9)
                if len(times) == 3 and iters is None:  # the first ones fault pages in
                    iters = iters_for(times[-1], args) + 3
            t = statistics.median(times[3:] or times)
            out.append(
                {"size": n, "time_us": t * 1e6, "bw_gbs": n / t / 1e9, "iters": len(times) - 3}
            )
        ctl[_XFER] = -1
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
        del ctl, ring
        shm.close()
    return out


# ----------------------------------------------------------------------------- worker


def make_cell(dist, torch, op, size, rank, world, group):
    """Buffers of one (op, size) on one group: (call, result, expected, reset, count)."""
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    )
    count = counts_for(op, size, world)
    chunk = count // world
    base = torch.arange(count, dtype=torch.float32) % 13
    nothing = lambda: None  # noqa: E731
    # rank-dependent inputs whose results are exact in float32
    if op == "all_reduce":
        a = base + rank
        want = base * world + world * (world - 1) / 2
        return (lambda: dist.all_reduce(a, group=group)), (lambda: a), want, a.zero_, count
    if op == "all_gather_single":
        inp, o = base[:chunk] + 100 * rank, torch.empty(count)
        want = torch.cat([base[:chunk] + 100 * j for j in range(world)])
        return (lambda: all_gather_single(o, inp, group=group)), (lambda: o), want, nothing, count
    if op == "reduce_scatter_single":
        inp, o = base + rank, torch.empty(chunk)
        want = (base * world + world * (world - 1) / 2)[rank * chunk : (rank + 1) * chunk]
        return (
            (lambda: reduce_scatter_single(o, inp, group=group)),
            (lambda: o),
            want,
            inp.zero_,
            count,
        )
    if op == "all_to_all_single":
        inp = torch.cat([base[:chunk] + 100 * rank + 10 * j for j in range(world)])
        o = torch.empty(count)
        want = torch.cat([base[:chunk] + 100 * j + 10 * rank for j in range(world)])
        return (
            (lambda: dist.all_to_all_single(o, inp, group=group)),
            (lambda: o),
            want,
            nothing,
            count,
        )
    if op == "broadcast":
        a = base + 7 if rank == 0 else torch.full((count,), -1.0)
        return (
            (lambda: dist.broadcast(a, src=0, group=group)),
            (lambda: a),
            base + 7,
            nothing,
            count,
        )
    raise ValueError(f"unknown op {op}")


def worker_main(args) -> int:
    """One rank. Rank 0 writes one JSON line per (backend, op, size) to --out.

    The default process group is gloo and serves only as the control plane (barriers
    between blocks, agreeing on iteration counts, collecting times), so it never depends
    on, nor is counted against, a backend under test. Each backend under test gets its own
    group over all ranks; with several, each cell is measured in rounds that alternate
    between them, so slow drifts of the machine hit all backends alike.
    """
    import ctypes

    try:  # die with the parent, even if it is killed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != args.parent_pid:
        return 1

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, args.world_size
    store = dist.TCPStore(
        "127.0.0.1", args.port, world, is_master=False, timeout=timedelta(seconds=args.timeout)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout)
    )
    ctrl = dist.group.WORLD
    specs = [parse_backend(b) for b in args.backends.split(",")]
    groups = {}
    for label, backend, transport in specs:
        opts = None
        if backend == "mooncake":
            import mooncake_pg

            opts = mooncake_pg.MooncakeOptions(timeout=float(args.op_timeout), transport=transport)
        groups[label] = dist.new_group(backend=backend, pg_options=opts)
        t = torch.zeros(1)
        for _ in range(3):  # connections and buffers are set up before any timing
            dist.all_reduce(t, group=groups[label])
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    out = open(args.out, "a") if rank == 0 else None

    def emit(rec):
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    def flagged(bit):
        """OR of one bit per rank, over all ranks."""
        t = torch.tensor([1 << rank if bit else 0], dtype=torch.int64)
        dist.all_reduce(t, group=ctrl)
        return [r for r in range(world) if t.item() >> r & 1]

    dist.barrier(group=ctrl)
    for op in args.ops.split(","):
        for size in sizes:
            cells = {}
            for label, _, _ in specs:
                call, result, want, reset, count = make_cell(
                    dist, torch, op, size, rank, world, groups[label]
                )
                rec = {"backend": label, "op": op, "size": count * ELEM, "count": count}
                # 1. one checked call; everyone learns whether any rank raised or was wrong
                err = ""
                try:
                    call()
                    ok = torch.equal(result(), want)
                except Exception as e:  # a raising op is reported, the benchmark goes on
                    ok, err = False, f"{type(e).__name__}: {e}"
                    print(
                        f"[rank {rank}] {label} {op} {size} B: {err}", file=sys.stderr, flush=True
                    )
                raised, wrong = flagged(bool(err)), flagged(not ok)
                if raised:
                    emit(
                        dict(
                            rec,
                            ok=False,
                            wrong_ranks=wrong,
                            error=f"raised on ranks {raised}"
                            + (f" (rank 0: {err})" if err else ""),
                        )
                    )
                    continue  # don't time an op that raises
                if wrong:
                    rec.update(ok=False, wrong_ranks=wrong, error=f"wrong result on ranks {wrong}")
                else:
                    rec["ok"] = True
                reset()  # timed calls keep values bounded (zeros stay zeros)
                # 2. warm-up; its median time sizes the run (the same N on every rank)
                warm = args.warmup + (8 if size <= SMALL else 0)
                tw = []
                for _ in range(warm):
                    t0 = time.perf_counter()
                    call()
                    tw.append(time.perf_counter() - t0)
                tw_t = torch.tensor([statistics.median(tw) if tw else 0.0], dtype=torch.float64)
                dist.all_reduce(tw_t, op=dist.ReduceOp.MAX, group=ctrl)
                n = iters_for(tw_t.item(), args)
                cells[label] = [call, rec, n, [], []]
            # 3. timed calls in rounds; in each round every backend runs one block of
            # calls after a barrier, so the backends alternate in small blocks and a slow
            # phase of the machine hits them alike; the order rotates between rounds
            order = list(cells)
            rounds = max([args.rounds] + [math.ceil(c[2] / args.block) for c in cells.values()])
            for label in order:
                cells[label][2] = max(1, math.ceil(cells[label][2] / rounds))  # calls per block
            for rnd in range(rounds):
                k = rnd % len(order) if order else 0
                for label in order[k:] + order[:k]:
                    call, rec, per_block, times, cpus = cells[label]
                    dist.barrier(group=ctrl)
                    c0 = time.process_time()
                    for _ in range(per_block):
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    cpus.append((time.process_time() - c0) / per_block)
            for label in order:
                call, rec, per_block, times, cpus = cells[label]
                tt = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=ctrl)  # max over ranks, per call
                tl = sorted(tt.tolist())
                tmed = statistics.median(tl)
                algbw = rec["size"] / tmed / 1e9
                # CPU seconds per call of every rank (all threads), summed over the ranks
                ct = torch.tensor(cpus, dtype=torch.float64)
                dist.all_reduce(ct, op=dist.ReduceOp.SUM, group=ctrl)
                rec["cpu_us"] = statistics.median(ct.tolist()) * 1e6
                rec.update(
                    iters=len(times),
                    rounds=rounds,
                    warmup=args.warmup + (8 if size <= SMALL else 0),
                    time_us=tmed * 1e6,
                    min_us=tl[0] * 1e6,
                    p10_us=tl[len(tl) // 10] * 1e6,
                    p90_us=tl[(len(tl) * 9) // 10] * 1e6,
                    algbw_gbs=algbw,
                    busbw_gbs=algbw * BUS_FACTOR[op](world),
                )
                emit(rec)
            del cells
    dist.barrier(group=ctrl)
    emit({"done": True})  # the parent allows the teardown below a limited time
    if out:
        out.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------ orchestrator

_children: list[subprocess.Popen] = []


def _kill_children():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.faults import kill_group

    for p in _children:
        kill_group(p, wait_s=5)  # each rank leads its own session
    _children.clear()


def _on_signal(signum, frame):
    _kill_children()
    sys.exit(128 + signum)


SHUTDOWN_LIMIT = 30  # seconds the ranks get to tear down after the last measurement


def _last_line(path):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4096))
        lines = f.read().splitlines()
    try:
        return json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}


def launch(world, backend_spec, args, logdir):
    """Runs one set of ranks for one world size and the backends of backend_spec (a comma
    list): returns (records, error or None, seconds)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout),
    )
    tag = f"ws{world}_{backend_spec.replace(':', '-').replace(',', '+')}"
    res_path = os.path.join(logdir, f"{tag}.jsonl")
    open(res_path, "w").close()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    logs = []
    t0 = time.monotonic()
    for r in range(world):
        log_path = os.path.join(logdir, f"{tag}_rank{r}.log")
        logs.append(log_path)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--_worker",
            "--rank",
            str(r),
            "--world-size",
            str(world),
            "--port",
            str(store.port),
            "--backends",
            backend_spec,
            "--sizes",
            args.sizes,
            "--ops",
            args.ops,
            "--out",
            res_path,
            "--parent-pid",
            str(os.getpid()),
            "--timeout",
            str(args.timeout),
            "--op-timeout",
            str(args.op_timeout),
            "--budget",
            str(args.budget),
            "--min-iters",
            str(args.min_iters),
            "--max-iters",
            str(args.max_iters),
            "--warmup",
            str(args.warmup),
            "--block",
            str(args.block),
            "--rounds",
            str(args.rounds),
        ]
        with open(log_path, "w") as lf:
            _children.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=lf,
                    stderr=lf,
                    env=env,
                    start_new_session=True,
                )
            )
    procs = list(_children)
    error, done = None, False
    deadline = t0 + args.timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            bad = [(r, c) for r, c in enumerate(codes) if c != 0]
            if bad:
                error = "rank(s) exited with " + ", ".join(f"{r}: {c}" for r, c in bad)
            break
        if any(c not in (None, 0) for c in codes):
            # one rank died: give the others a moment to fail on their own, then kill
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            codes = [p.poll() for p in procs]
            error = "rank(s) failed: " + ", ".join(
                f"{r}: {c}" for r, c in enumerate(codes) if c not in (None, 0)
            )
            break
        if not done and os.path.getsize(res_path) and _last_line(res_path).get("done"):
            done = True  # all measured: the ranks now only tear down their groups
            deadline = min(deadline, time.monotonic() + SHUTDOWN_LIMIT)
        if time.monotonic() > deadline:
            error = (
                f"ranks did not exit within {SHUTDOWN_LIMIT} s after the last measurement "
                "(destroy_process_group hangs?)"
                if done
                else f"timed out after {args.timeout:.0f} s"
            )
            break
        time.sleep(0.05)
    _kill_children()
    del store
    recs = []
    with open(res_path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if not rec.get("done"):
                    recs.append(rec)
    if error:
        tails = []
        for r, lp in enumerate(logs):
            with open(lp, errors="replace") as f:
                tail = f.read()[-1500:].strip()
            if tail:
                tails.append(f"--- rank {r} ({lp}) ---\n{tail}")
        error += "\n" + "\n".join(tails[:2])
    return recs, error, time.monotonic() - t0


def _cpu_times():
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children)."""
    import resource

    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        machine = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine = float("nan")
    ours = sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return machine, ours


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of this machine's CPU time that was busy over the next `seconds`."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
        return 1.0 - (i1 - i0) / max(1, t1 - t0)
    except (OSError, ValueError, IndexError):
        return 0.0


def fmt_row(cells, widths):
    return " ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))
    )


def ceiling_pct(ceiling, busbw, size):
    """busbw as % of the copy ceiling at the nearest measured size at or below `size`."""
    bw = {c["size"]: c["bw_gbs"] for c in ceiling}
    cands = [s for s in bw if s <= size] or list(bw)
    return 100 * busbw / bw[max(cands)] if cands and bw[max(cands)] else None


def render_tables(results, ceiling, args, backends, world_sizes, md=False, sizes=None, ref="gloo"):
    """The result tables, one per world size, as text (md=False) or markdown."""
    others = [b for b in backends if b != ref] if ref in backends else []
    lines = []

    def pct(r):
        p = r.get("pct_ceiling")
        return "-" if p is None else (f"{p:.0f}%" if p >= 10 else f"{p:.1f}%")

    for world in world_sizes:
        head = ["op", "size", "count"]
        widths = [21, 10, 9]
        for b in backends:
            head += [f"{b[:14]} time(us)", "algbw", "busbw", "%ceil", "CPU(us)"]
            widths += [max(14, len(b[:14]) + 9), 7, 7, 6, 9]
        for b in others:
            head += [f"{b[:10]}/{ref} busbw", "time ratio", "CPU ratio"]
            widths += [max(13, len(b[:10]) + len(ref) + 7), 10, 9]
        title = (
            f"world size {world}: float32, one torch thread per rank, time = median over calls "
            f"of the slowest rank; GB/s; %ceil = busbw / shm copy ceiling"
        )
        lines.append("")
        if md:
            lines += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        else:
            lines += [title, fmt_row(head, widths), "-" * (sum(widths) + len(widths) - 1)]
        for op in args.ops.split(","):
            rows = {}
            for b in backends:
                for r in results.get((world, b), []):
                    if r["op"] == op:
                        rows.setdefault(r["size"], {})[b] = r
            for size in sorted(rows):
                if sizes and not any(counts_for(op, x, world) * ELEM == size for x in sizes):
                    continue
                row = rows[size]
                count = next(iter(row.values()))["count"]
                cells = [op, human(size) if md else size, count]
                for b in backends:
                    r = row.get(b)
                    if r is None or "time_us" not in r:
                        cells += ["ERROR" if r else "-", "-", "-", "-", "-"]
                    else:
                        t = f"{r['time_us']:.1f}" + ("" if r.get("ok") else " WRONG")
                        cpu = f"{r['cpu_us']:.1f}" if "cpu_us" in r else "-"
                        cells += [t, f"{r['algbw_gbs']:.2f}", f"{r['busbw_gbs']:.2f}", pct(r), cpu]
                for b in others:
                    r, g = row.get(b), row.get(ref)
                    if r and g and "time_us" in r and "time_us" in g:
                        cells += [
                            f"{r['busbw_gbs'] / g['busbw_gbs']:.2f}x",
                            f"{r['time_us'] / g['time_us']:.2f}x" if size < SMALL else "",
                            f"{r['cpu_us'] / g['cpu_us']:.2f}x"
                            if r.get("cpu_us") and g.get("cpu_us")
                            else "-",
                        ]
                    else:
                        cells += ["-", "", "-"]
                lines.append(
                    "| " + " | ".join(str(c) for c in cells) + " |"
                    if md
                    else fmt_row(cells, widths)
                )
    lines.append("")
    lines.append(
        "shm copy ceiling (two processes, one thread each, pipelined through shared memory): "
        + ", ".join(f"{human(c['size'])} {c['bw_gbs']:.2f} GB/s" for c in ceiling)
    )
    return "\n".join(lines)


def check_gates(results, gate_backend, ref="gloo"):
    """Speed gates of docs/design.md "Benchmarks". Returns a list of (passed or None, line)."""
    lines = []

    def get(world, backend, op, size):
        for r in results.get((world, backend), []):
            if r["op"] == op and r["size"] == size and "time_us" in r and r.get("ok"):
                return r
        return None

    def sizes(world, op):
        return sorted(
            {
                r["size"]
                for b in (gate_backend, ref)
                for r in results.get((world, b), [])
                if r["op"] == op
            }
        )

    # world size 2: busbw of all_reduce and all_to_all_single at 1..64 MiB >= 3x gloo
    for op in ("all_reduce", "all_to_all_single"):
        got = [s for s in sizes(2, op) if MiB <= s <= 64 * MiB]
        if not got:
            lines.append(
                (None, f"SKIP  ws=2 {op} 1..64 MiB busbw >= 3x {ref}: no size in range measured")
            )
        for s in got:
            m, g = get(2, gate_backend, op, s), get(2, ref, op, s)
            if not (m and g):
                lines.append((False, f"FAIL  ws=2 {op} {human(s)}: not measured or wrong result"))
                continue
            x = m["busbw_gbs"] / g["busbw_gbs"]
            lines.append(
                (
                    x >= 3.0,
                    f"{'PASS' if x >= 3 else 'FAIL'}  ws=2 {op} {human(s)}: busbw "
                    f"{m['busbw_gbs']:.2f} vs {g['busbw_gbs']:.2f} GB/s = {x:.2f}x {ref} (gate >= 3x, target 5x: "
                    f"{'met' if x >= 5 else 'not met'})",
                )
            )
    # world size 2: all_reduce of 8 B at most 25 us
    m, g = get(2, gate_backend, "all_reduce", 8), get(2, ref, "all_reduce", 8)
    if m is None:
        lines.append(
            (
                None if 8 not in sizes(2, "all_reduce") else False,
                f"{'SKIP' if 8 not in sizes(2, 'all_reduce') else 'FAIL'}  ws=2 all_reduce 8 B <= 25 us: not measured",
            )
        )
    else:
        t = m["time_us"]
        tgt = (
            f", target 1/40 of {ref}'s {g['time_us']:.1f} us: {'met' if g and t <= g['time_us'] / 40 else 'not met'}"
            if g
            else ""
        )
        lines.append(
            (
                t <= 25.0,
                f"{'PASS' if t <= 25 else 'FAIL'}  ws=2 all_reduce 8 B: {t:.1f} us (gate <= 25 us{tgt})",
            )
        )
    # world size 4: no worse than gloo (>= 0.9x busbw) anywhere
    any4 = False
    for op in OPS:
        for s in sizes(4, op):
            any4 = True
            m, g = get(4, gate_backend, op, s), get(4, ref, op, s)
            if not (m and g):
                lines.append((False, f"FAIL  ws=4 {op} {human(s)}: not measured or wrong result"))
                continue
            x = m["busbw_gbs"] / g["busbw_gbs"]
            if x < 0.9:
                lines.append(
                    (False, f"FAIL  ws=4 {op} {human(s)}: busbw {x:.2f}x {ref} (gate >= 0.9x)")
                )
            else:
                lines.append((True, f"PASS  ws=4 {op} {human(s)}: busbw {x:.2f}x {ref}"))
    if not any4:
        lines.append((None, "SKIP  ws=4 no worse than gloo: world size 4 not measured"))
    return lines


def orchestrate(args) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for op in args.ops.split(","):
        if op not in OPS:
            sys.exit(f"pg_bench: unknown op {op!r} (choose from {', '.join(OPS)})")
    json_path = args.json
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="pg_bench_")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    t_start = time.monotonic()
    print(
        f"pg_bench: backends {backends}, world sizes {world_sizes}, sizes "
        f"{human(min(sizes))}..{human(max(sizes))} ({len(sizes)}), ops {args.ops}"
        f"{' [smoke]' if args.smoke else ''}; rank logs in {logdir} (kept on error)",
        flush=True,
    )

    busy = cpu_busy(1.0)
    cpu0, wall0 = _cpu_times(), time.monotonic()
    if busy > 0.15:
        print(
            f"  WARNING: the machine was {100 * busy:.0f}% busy before the run started; "
            "numbers measured now are unreliable",
            flush=True,
        )
    t0 = time.monotonic()
    ceiling = measure_ceiling(sizes, args)  # before torch is imported here: it forks
    print(f"  copy ceiling measured ({time.monotonic() - t0:.1f} s)", flush=True)

    results, errors = {}, []
    for world in world_sizes:
        # one set of ranks for all backends (rounds alternate between them), or, with
        # --isolate, a fresh set of ranks per backend
        for spec in [[b] for b in backends] if args.isolate else [backends]:
            recs, err, dt = launch(world, ",".join(spec), args, logdir)
            for b in spec:
                results[(world, b)] = [r for r in recs if r["backend"] == b]
            wrong = [r for r in recs if not r.get("ok")]
            state = (
                "ok"
                if not err and not wrong
                else ("FAILED" if err else f"{len(wrong)} wrong result(s)")
            )
            print(
                f"  world size {world}, {'+'.join(spec)}: {len(recs)} measurements in {dt:.1f} s: {state}",
                flush=True,
            )
            if err:
                errors.append(f"world size {world}, {'+'.join(spec)}: {err}")
            for r in wrong:
                errors.append(
                    f"world size {world}, {r['backend']}: {r['op']} {r['size']} B: {r.get('error')}"
                )

    for recs in results.values():
        for r in recs:
            if "busbw_gbs" in r:
                r["pct_ceiling"] = ceiling_pct(ceiling, r["busbw_gbs"], r["size"])
    print(render_tables(results, ceiling, args, backends, world_sizes))
    gates = []
    if args.gate or args.gate_strict:
        print()
        gb = args.gate_backend
        if gb not in backends or "gloo" not in backends:
            print(f"GATE  SKIP: needs backends {gb} and gloo in the run")
        else:
            gates = check_gates(results, gb)
            for _, line in gates:
                print("GATE  " + line)
            failed = sum(1 for p, _ in gates if p is False)
            print(
                f"GATE  {'PASS' if failed == 0 else 'FAIL'}: {sum(1 for p, _ in gates if p)} passed, {failed} failed"
            )
    total = time.monotonic() - t_start
    cpu1 = _cpu_times()
    # CPU time other processes of this machine used while the benchmark ran
    foreign = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / max(
        1e-9, (time.monotonic() - wall0) * (os.cpu_count() or 1)
    )
    if foreign > 0.05:
        print(
            f"\nWARNING: other processes used {100 * foreign:.0f}% of this machine's CPU time during the run;"
            " the numbers are unreliable, rerun on a quiet machine",
            flush=True,
        )

    import torch

    doc = {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "node": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": total,
            "cpu_busy_before": busy,
            "foreign_cpu_share": foreign,
            "loadavg_after": os.getloadavg(),
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "dtype": "float32",
            "threads_per_rank": 1,
            "method": "median over calls of the max over ranks; busbw factors of nccl-tests",
        },
        "ceiling": ceiling,
        "results": [dict(r, world_size=w) for (w, b), recs in results.items() for r in recs],
        "gates": [{"pass": p, "line": line} for p, line in gates],
        "errors": errors,
    }
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    md_path = os.path.splitext(json_path)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(
            f"pg_bench on {os.cpu_count()} CPUs, torch {torch.__version__}, {doc['meta']['time']}\n\n"
        )
        f.write("Summary (for the README):\n")
        f.write(
            render_tables(
                results, ceiling, args, backends, world_sizes, md=True, sizes=README_SIZES
            )
        )
        f.write("\n\nAll sizes:\n")
        f.write(render_tables(results, ceiling, args, backends, world_sizes, md=True))
        f.write("\n")
        if gates:
            f.write("\nGates:\n\n" + "".join(f"- {line}\n" for _, line in gates))
    print(f"\npg_bench: JSON in {json_path}, markdown tables in {md_path}; {total:.1f} s in all")
    if not errors:
        import shutil

        shutil.rmtree(logdir, ignore_errors=True)
    if errors:
        print("pg_bench: ERRORS:", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        return 1
    if args.gate_strict and any(p is False for p, _ in gates):
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    ap.add_argument(
        "--backends",
        default="mooncake,gloo",
        help="comma list; 'mooncake:tcp' / 'mooncake:shm' force a transport (default mooncake,gloo)",
    )
    ap.add_argument("--world-sizes", default="2,4", help="comma list (default 2,4)")
    ap.add_argument(
        "--sizes", default=None, help=f"comma list of bytes, K/M suffixes (default {DEFAULT_SIZES})"
    )
    ap.add_argument("--ops", default=",".join(OPS), help="comma list (default: all five)")
    ap.add_argument(
        "--json", default=os.path.join("bench_out", "pg_bench.json"), help="JSON output path"
    )
    ap.add_argument("--smoke", action="store_true", help="CI: tiny sizes, few iterations")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of timed calls per cell (default 0.25, smoke 0.01)",
    )
    ap.add_argument("--min-iters", type=int, default=None, help="default 5 (smoke 2)")
    ap.add_argument("--max-iters", type=int, default=None, help="default 300 (smoke 10)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up calls (+8 below 64 KiB); default 2 (smoke 1)",
    )
    ap.add_argument(
        "--block",
        type=int,
        default=50,
        help="timed calls of one backend between two barriers, at most (default 50)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per cell at least; each round runs one block per backend (default 4, smoke 1)",
    )
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="a fresh set of rank processes per backend instead of one set for all",
    )
    ap.add_argument(
        "--timeout", type=float, default=None, help="seconds per launch (default 900, smoke 120)"
    )
    ap.add_argument(
        "--op-timeout", type=float, default=60.0, help="MooncakeOptions(timeout=) (default 60)"
    )
    ap.add_argument(
        "--gate",
        action="store_true",
        help="check the speed gates of docs/design.md; prints PASS/FAIL lines",
    )
    ap.add_argument(
        "--gate-strict", action="store_true", help="like --gate, and exit 1 when a gate fails"
    )
    ap.add_argument(
        "--gate-backend", default="mooncake", help="backend the gates compare with gloo"
    )
    # internal: one rank
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = args.smoke
    for name, full, smoke in (
        ("budget", 0.25, 0.01),
        ("min_iters", 5, 2),
        ("max_iters", 300, 10),
        ("warmup", 2, 1),
        ("timeout", 900.0, 120.0),
        ("rounds", 4, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, smoke if s else full)
    if args.sizes is None:
        args.sizes = SMOKE_SIZES if s else DEFAULT_SIZES
    if args._worker:
        args.backend = args.backends
        try:
            return worker_main(args)
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # don't hang in the process group's teardown
    try:
        return orchestrate(args)
    finally:
        _kill_children()


if __name__ == "__main__":
    sys.exit(main())
