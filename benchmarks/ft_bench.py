"""Failure detection + agreement time of the ``mooncake`` process group.

Each trial starts a fresh group of ``--world-size`` rank processes (forked from a zygote
that has imported torch; see tests/rankpool.py), runs all_reduce in a loop, and SIGKILLs
a random rank (rank 0 included) at a random iteration. The victim writes the wall-clock
time just before it kills itself; every survivor records when its op raised
``RankFailureError`` (policy ``raise``) or completed over the survivors (``mask``).
Detection + agreement time = survivor's time - kill time (one host, one clock).

Prints, over all trials: median and max detection time, hangs (a survivor that did not
answer in time), disagreements (survivors with different failed sets or epochs) and
wrong results (the next all_reduce differs from the sum over the survivors). The last
three must be 0. JSON with every trial goes to ``--json``.

    .venv/bin/python benchmarks/ft_bench.py --trials 50
    .venv/bin/python benchmarks/ft_bench.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: the test helpers' package

from tests import rankpool  # noqa: E402


def rank_trial(rank, ws, victim, kill_at, stamp_path, iters):
    import torch
    import torch.distributed as dist

    import mooncake_pg

    g = dist.new_group(list(range(ws)))
    detected = None
    outcome = None
    for it in range(iters):
        x = torch.tensor([float(rank + 1)])
        if rank == victim and it == kill_at:
            with open(stamp_path, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(x, group=g)
            if detected is None and mooncake_pg.get_epoch(g) > 0:
                detected = time.time()  # mask: the op in flight completed over survivors
                outcome = ("completed", x.item())
        except mooncake_pg.RankFailureError as e:
            detected = time.time()
            outcome = ("raised", sorted(e.failed_ranks), e.epoch)
        if detected is not None:
            break
    nxt = torch.tensor([float(rank + 1)])
    dist.all_reduce(nxt, group=g)
    return {
        "detected": detected,
        "outcome": outcome,
        "epoch": mooncake_pg.get_epoch(g),
        "active": mooncake_pg.get_active_ranks(g).tolist(),
        "next": nxt.item(),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--policy", default="raise", choices=["raise", "mask"])
    ap.add_argument("--op-timeout", type=float, default=10.0, help="MooncakeOptions.timeout (s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="bench_out/ft_bench.json")
    ap.add_argument("--smoke", action="store_true", help="CI: 3 trials")
    args = ap.parse_args(argv)
    if args.smoke:
        args.trials = 3
    rng = random.Random(args.seed)
    ws = args.world_size
    rows, lat = [], []
    hangs = disagreements = wrong = 0
    tmp = tempfile.mkdtemp(prefix="ft_bench_")
    t0 = time.time()
    for trial in range(args.trials):
        victim, kill_at = rng.randrange(ws), rng.randrange(5, 40)
        stamp = os.path.join(tmp, f"kill{trial}")
        pool = rankpool.RankPool(
            ws,
            "mooncake",
            args.transport,
            op_timeout=args.op_timeout,
            options={"on_failure": args.policy},
        )
        try:
            res = pool.run(
                rank_trial,
                victim,
                kill_at,
                stamp,
                200,
                timeout=args.op_timeout * 3 + 10,
                return_exceptions=True,
            )
        except rankpool.RankTimeout as e:
            hangs += 1
            rows.append({"trial": trial, "victim": victim, "hang": str(e)[:300]})
            continue
        finally:
            pool.close(graceful=False)
        with open(stamp) as f:
            killed = float(f.read())
        survivors = [r for r in range(ws) if r != victim]
        outs = [res[r] for r in survivors]
        bad = [o for o in outs if isinstance(o, rankpool.RemoteError)]
        if bad:
            hangs += 1
            rows.append({"trial": trial, "victim": victim, "error": [str(b)[:300] for b in bad]})
            continue
        d = [o["detected"] - killed for o in outs]
        lat.extend(d)
        agree = len({(str(o["outcome"]), o["epoch"], tuple(o["active"])) for o in outs}) == 1
        expect_active = [0 if r == victim else 1 for r in range(ws)]
        if not agree or outs[0]["active"] != expect_active or outs[0]["epoch"] != 1:
            disagreements += 1
        expect_sum = float(sum(r + 1 for r in survivors))
        if any(o["next"] != expect_sum for o in outs):
            wrong += 1
        if args.policy == "raise" and any(o["outcome"][:2] != ("raised", [victim]) for o in outs):
            disagreements += 1
        rows.append(
            {
                "trial": trial,
                "victim": victim,
                "kill_at": kill_at,
                "detect_s": d,
                "outcomes": [o["outcome"] for o in outs],
            }
        )
        print(
            f"trial {trial:3d}: killed rank {victim} at op {kill_at:2d}: detected+agreed in "
            f"{1000 * max(d):7.1f} ms (max over survivors)",
            flush=True,
        )
    summary = {
        "trials": args.trials,
        "world_size": ws,
        "transport": args.transport,
        "policy": args.policy,
        "op_timeout_s": args.op_timeout,
        "detect_median_ms": 1000 * statistics.median(lat) if lat else None,
        "detect_max_ms": 1000 * max(lat) if lat else None,
        "hangs": hangs,
        "disagreements": disagreements,
        "wrong_results": wrong,
        "wall_s": time.time() - t0,
    }
    print()
    print(
        "| trials | world size | transport | policy | detect+agree median (ms) | max (ms) | hangs | disagreements | wrong results |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.trials} | {ws} | {args.transport} | {args.policy} | {summary['detect_median_ms']:.1f} | "
        f"{summary['detect_max_ms']:.1f} | {hangs} | {disagreements} | {wrong} |"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"summary": summary, "trials": rows}, f, indent=1)
    rankpool.shutdown_all()
    return 0 if hangs == disagreements == wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
