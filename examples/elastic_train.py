"""Elastic data-parallel training that survives a dead rank, under ``mooncake-run``.

Run (4 ranks; rank 1 SIGKILLs itself at step 40, the launcher respawns it)::

    .venv/bin/mooncake-run --nproc-per-node 4 examples/elastic_train.py [--kill-rank 1 --kill-at 40]

What happens:

1. Every rank builds the same small model (same seed) and trains it on its own shard of
   a synthetic regression task. Gradients are averaged over the ranks that contributed:
   a trailing ``1`` is summed with them, so the divisor comes from the same all_reduce
   (``on_failure="mask"``: the all_reduce in flight when a rank dies completes over the
   survivors).
2. The victim dies (first start only). The survivors notice within milliseconds (process
   handles), agree on it through the control store, and go on with three ranks.
3. ``mooncake-run`` respawns the victim alone with ``MOONCAKE_IS_RECOVERY=1``: its
   ``init_process_group`` registers it as a joiner (``mooncake_pg.is_joining()``), it calls
   ``join_group`` and waits.
4. The survivors, between two steps, call ``recover_ranks(None, get_pending_ranks())``;
   when it admits someone, everybody calls ``sync_state(model, optimizer, step=step)``,
   which hands the joiner the parameters, the Adam state, the RNG state and the step.
5. At the end every rank checks that the group is full again and the parameters are
   bit-identical on all ranks (rank 0 prints a summary; exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import mooncake_pg

torch.set_num_threads(1)


def log(msg: str) -> None:
    sys.stdout.write(f"[rank {dist.get_rank()}] {msg}\n")
    sys.stdout.flush()


def batch(rank: int, step: int):
    """This rank's shard at ``step``: y = x @ w_true + noise."""
    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + 7919 * rank)
    x = torch.randn(64, 32, generator=g)
    w_true = torch.linspace(-1.0, 1.0, 32 * 8, dtype=torch.float32).view(32, 8)
    return x, x @ w_true + 0.01 * torch.randn(64, 8, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kill-rank", type=int, default=1, help="rank that SIGKILLs itself (-1: none)")
    ap.add_argument("--kill-at", type=int, default=40, help="step at which it dies")
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.05,
        help="simulated compute per step, seconds (a respawned rank needs a few "
        "seconds to start, so it rejoins mid-run)",
    )
    ap.add_argument(
        "--hidden",
        type=int,
        default=64,
        help="width of the hidden layer (the gradient all_reduce carries about 40*hidden floats)",
    )
    ap.add_argument(
        "--rejoin-timeout",
        type=float,
        default=120.0,
        help="seconds the ranks wait at the end for respawned ranks",
    )
    args = ap.parse_args()

    dist.init_process_group(
        "mooncake", pg_options=mooncake_pg.MooncakeOptions(on_failure="mask", timeout=30)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 8)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step, recoveries, t0 = 0, 0, time.monotonic()
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # set by mooncake-run

    if mooncake_pg.is_joining():
        log("respawned: waiting to be admitted")
        mooncake_pg.join_group(timeout=args.rejoin_timeout)
        step = mooncake_pg.sync_state(model, opt, step=step)
        log(
            f"rejoined at step {step}; active ranks {mooncake_pg.get_active_ranks().nonzero().flatten().tolist()}"
        )

    def lowest_active() -> int:
        return min(r for r, a in enumerate(mooncake_pg.get_active_ranks().tolist()) if a)

    def admit_joiners() -> None:
        nonlocal step, recoveries
        if mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks()):
            step = mooncake_pg.sync_state(model, opt, step=step)
            recoveries += 1
            if rank == lowest_active():
                log(
                    f"step {step}: admitted respawned ranks; active {mooncake_pg.get_active_ranks().tolist()}"
                )

    losses = []
    while step < args.steps:
        if rank == args.kill_rank and step == args.kill_at and first_start:
            log(f"step {step}: SIGKILL myself")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        params = list(model.parameters())
        flat = torch.cat(
            [p.grad.flatten() for p in params] + [loss.detach().view(1), torch.ones(1)]
        )
        dist.all_reduce(flat)
        n = flat[-1].item()
        off = 0
        for p in params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p) / n)
            off += p.numel()
        opt.step()
        losses.append(flat[-2].item() / n)
        if rank == lowest_active() and (step % 20 == 0 or (int(n) != world and step % 5 == 0)):
            log(f"step {step}: loss {losses[-1]:.4f} over {int(n)} ranks")
        step += 1
        time.sleep(args.step_time)
        admit_joiners()

    # wait until every seat is back (a respawned rank may still be starting)
    deadline = time.monotonic() + args.rejoin_timeout
    while not all(mooncake_pg.get_active_ranks().tolist()) and time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.1)
        admit_joiners()
    active = mooncake_pg.get_active_ranks().tolist()
    # identical parameters everywhere: compare every rank's digest
    mine = torch.tensor(list(bytes.fromhex(digest(model))), dtype=torch.uint8)
    out = torch.zeros(world, mine.numel(), dtype=torch.uint8)
    dist.all_gather_single(out, mine)
    same = all(torch.equal(out[r], mine) for r, a in enumerate(active) if a)
    ok = all(active) and same
    # the summary comes from the lowest rank that trained from the start
    reporter = torch.tensor([rank if first_start else world], dtype=torch.int64)
    dist.all_reduce(reporter, op=dist.ReduceOp.MIN)
    if rank == reporter.item():
        log(
            f"done: {step} steps in {time.monotonic() - t0:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{recoveries} recoveries, epoch {mooncake_pg.get_epoch()}, active {active}, "
            f"parameters identical on all ranks: {same}"
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
