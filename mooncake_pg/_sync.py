"""``sync_state``: broadcast module, optimizer and RNG state to rejoined ranks.

Only JSON metadata and tensors cross the wire: nothing is unpickled.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _bcast_json(obj, src, group, is_src):
    if is_src:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    if not is_src:
        data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(data, src, group=group)
    return json.loads(bytes(data.tolist()).decode()) if not is_src else obj


def _default_src(group):
    from . import backend_of

    be = backend_of(group)
    active = be.active_ranks()
    joined = set(be.last_joined())
    for r, a in enumerate(active):
        if a and r not in joined:
            return dist.get_global_rank(group, r) if group is not None else r
    raise ValueError("sync_state: no active rank that did not just join")


def sync_state(module=None, optimizer=None, src=None, group=None, step=None):
    if src is None:
        src = _default_src(group)
    me = dist.get_rank()
    is_src = me == src
    if module is not None:
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src, group=group)
    if optimizer is not None:
        sd = optimizer.state_dict()
        # structure: per param index, the state keys, which are tensors (shape/dtype) or numbers
        meta = None
        if is_src:
            meta = {"state": {}, "param_groups": sd["param_groups"]}
            for idx, st in sd["state"].items():
                entry = {}
                for k, v in st.items():
                    if torch.is_tensor(v):
                        entry[k] = {
                            "tensor": list(v.shape),
                            "dtype": str(v.dtype).replace("torch.", ""),
                        }
                    else:
                        entry[k] = {"value": v}
                meta["state"][str(idx)] = entry
        meta = _bcast_json(meta, src, group, is_src)
        new_state = {}
        for idx, entry in meta["state"].items():
            st = {}
            for k, d in entry.items():
                if "tensor" in d:
                    t = (
                        sd["state"][int(idx)][k].contiguous()
                        if is_src
                        else torch.empty(d["tensor"], dtype=getattr(torch, d["dtype"]))
                    )
                    dist.broadcast(t, src, group=group)
                    st[k] = t
                else:
                    st[k] = d["value"]
            new_state[int(idx)] = st
        if not is_src:
            optimizer.load_state_dict({"state": new_state, "param_groups": meta["param_groups"]})
    rng = torch.get_rng_state()
    dist.broadcast(rng, src, group=group)
    if not is_src:
        torch.set_rng_state(rng)
    # the step counter: [has_step, step]
    st = torch.tensor([1 if step is not None else 0, int(step or 0)], dtype=torch.int64)
    dist.broadcast(st, src, group=group)
    return int(st[1]) if int(st[0]) else None
