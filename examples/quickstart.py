"""Quick start: the ``mooncake`` process group on one host.

Run on 4 ranks (``bash scripts/quickstart.sh`` does the set-up, then this)::

    torchrun --standalone --nproc-per-node 4 examples/quickstart.py [--backend gloo]

Every rank runs a few collectives, prints and checks their results, then trains a tiny
model with DistributedDataParallel and checks that the replicas stay identical.
Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)  # the ranks share this host's cores

# torch 2.13 names, with the older ones where they are missing
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

failures: list[str] = []


def log(msg: str) -> None:
    # one write per line, so the lines of different ranks do not interleave
    sys.stdout.write(f"[rank {dist.get_rank()}] {msg}\n")
    sys.stdout.flush()


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Every rank checks its own result; rank 0 prints its values, the others only failures."""
    ok = got.shape == want.shape and torch.allclose(got, want)
    if not ok or dist.get_rank() == 0:
        log(f"{name:<18} {'ok  ' if ok else 'FAIL'} {got.tolist()}")
    if not ok:
        failures.append(f"{name}: got {got.tolist()}, want {want.tolist()}")


def collectives() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()

    # all_reduce: every rank holds rank+1; the sum is 1+2+...+world
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    check("all_reduce(sum)", t, torch.full((4,), world * (world + 1) / 2))

    # all_gather_single: rank r contributes [r, r]; everyone gets [0,0,1,1,...]
    out = torch.empty(2 * world)
    all_gather_single(out, torch.full((2,), float(rank)))
    check("all_gather", out, torch.arange(world, dtype=torch.float32).repeat_interleave(2))

    # all_to_all_single: rank r sends 10*r + j to rank j, so rank r receives 10*j + r from j
    inp = torch.tensor([10.0 * rank + j for j in range(world)])
    out = torch.empty(world)
    dist.all_to_all_single(out, inp)
    check("all_to_all_single", out, torch.tensor([10.0 * j + rank for j in range(world)]))

    # broadcast from the last rank
    src = world - 1
    t = torch.arange(3, dtype=torch.float32) + 100 if rank == src else torch.zeros(3)
    dist.broadcast(t, src=src)
    check("broadcast", t, torch.arange(3, dtype=torch.float32) + 100)

    # send/recv around a ring: nonblocking both ways so no rank waits on another's send
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(2)
        reqs = [dist.isend(torch.tensor([float(rank), 42.0]), dst=right), dist.irecv(got, src=left)]
        for r in reqs:
            r.wait()
        check("send/recv (ring)", got, torch.tensor([float(left), 42.0]))


def train_ddp(steps: int = 20) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts them anyway)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data shard
    w_true = torch.arange(8, dtype=torch.float32) / 8
    first = last = None
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = (x @ w_true).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg /= world
        first = avg.item() if first is None else first
        last = avg.item()
        if rank == 0 and step % 5 == 0:
            log(f"ddp step {step:>2}  mean loss {last:.4f}")
    if rank == 0:
        log(f"ddp step {steps - 1:>2}  mean loss {last:.4f} (from {first:.4f})")
    if not last < first:
        failures.append(f"ddp: the loss did not go down ({first:.4f} -> {last:.4f})")

    # replicas must be identical: compare every parameter with rank 0's
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.equal(flat, ref)
    if not same:
        log("ddp parameters differ from rank 0's: FAIL")
        failures.append("ddp: parameters differ from rank 0's")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mooncake", help="mooncake (default) or gloo")
    ap.add_argument(
        "--transport",
        default=None,
        choices=["auto", "shm", "tcp"],
        help="mooncake transport (default: MOONCAKE_TRANSPORT or auto)",
    )
    args = ap.parse_args()

    kwargs = {}
    if args.backend == "mooncake":
        import mooncake_pg  # registers the "mooncake" backend

        kwargs["pg_options"] = mooncake_pg.MooncakeOptions(timeout=30.0, transport=args.transport)
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    dist.init_process_group(args.backend, **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        log(f"backend {dist.get_backend()}, world size {world}, torch {torch.__version__}")
    try:
        collectives()
        train_ddp()
        # everyone learns whether anyone failed
        bad = torch.tensor([len(failures)])
        dist.all_reduce(bad)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    for f in failures:
        sys.stderr.write(f"[rank {rank}] FAILED {f}\n")
    if rank == 0:
        verdict = "all checks passed" if bad.item() == 0 else f"{bad.item()} check(s) FAILED"
        sys.stdout.write(
            f"quickstart: {verdict} on {world} ranks ({args.backend}), DDP replicas identical\n"
            if bad.item() == 0
            else f"quickstart: {verdict} on {world} ranks ({args.backend})\n"
        )
        sys.stdout.flush()
    return 0 if bad.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
