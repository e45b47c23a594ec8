"""The rank side of :mod:`tests.multihost`: ``python -m tests.multihost_rank`` with MH_* set.

Joins the group (``init_process_group(MH_BACKEND, init_method=MH_INIT, ...)``), runs the
scenario named by MH_SCENARIO with the JSON arguments of MH_ARGS, prints ``RESULT <json>``.
``MooncakeOptions`` come from MH_ARGS' "options" and, per rank, MH_OPTIONS (JSON).
An exception becomes ``{"error": type name, "message": ...}`` (still a RESULT line).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return {"tensor": x.tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ------------------------------------------------------------------ scenarios


def every_op(rank, world_size):
    """Every collective and p2p op once (tests.pg.every_op), on the default group."""
    from tests.pg.every_op import run_collectives

    return run_collectives()


SCENARIOS = {"every_op": every_op}


def main() -> None:
    rank, world_size = int(os.environ["MH_RANK"]), int(os.environ["MH_WORLD_SIZE"])
    args = json.loads(os.environ.get("MH_ARGS") or "{}")
    backend = os.environ.get("MH_BACKEND", "mooncake")
    try:
        torch.set_num_threads(1)
        kw = {}
        if backend == "mooncake":
            import mooncake_pg

            opts = {**args.pop("options", {}), **json.loads(os.environ.get("MH_OPTIONS") or "{}")}
            kw["pg_options"] = mooncake_pg.MooncakeOptions(**opts)
        dist.init_process_group(
            backend,
            init_method=os.environ["MH_INIT"],
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
            **kw,
        )
        res = SCENARIOS[os.environ["MH_SCENARIO"]](rank, world_size, **args)
        dist.destroy_process_group()
    except BaseException as e:  # reported, not raised: the test compares outcomes
        res = {
            "error": type(e).__name__,
            "message": str(e)[:2000],
            "tb": traceback.format_exc()[-3000:],
            "unix_s": time.time(),
        }
    print("RESULT " + json.dumps(_jsonable(res)), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
