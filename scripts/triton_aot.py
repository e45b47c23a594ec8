"""Ahead-of-time compile of every Triton kernel in ``mooncake_ep.triton_kernels`` for
``GPUTarget("cuda", 90, 32)`` (sm_90; no GPU needed).

Kernels and their compile signatures come from ``triton_kernels.AOT_SIGNATURES`` (the one
list, also used by tests/ep/test_ep_triton.py). So that no kernel is missed, every
``@triton.jit`` function of the module must either be listed there or be called from a
listed kernel (a device helper); otherwise this fails naming it.

Usage: ``python scripts/triton_aot.py [--json OUT] [--arch 90]``; exit status 0 when every
kernel compiled to a cubin for the target. Prints one line per kernel with its time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90)")
    ap.add_argument(
        "--module",
        default="mooncake_ep.triton_kernels",
        help="module holding the kernels and AOT_SIGNATURES (default mooncake_ep.triton_kernels)",
    )
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # as the tests compile them
    # a fresh cache: every kernel is really compiled, not read back from ~/.triton
    import tempfile

    cache = tempfile.TemporaryDirectory(prefix="mooncake-triton-aot-")
    os.environ["TRITON_CACHE_DIR"] = cache.name

    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    tk = importlib.import_module(args.module)

    jitted = {name: obj for name, obj in vars(tk).items() if isinstance(obj, JITFunction)}
    listed = {id(fn) for fn, _, _ in tk.AOT_SIGNATURES.values()}
    listed_src = "\n".join(inspect.getsource(fn.fn) for fn, _, _ in tk.AOT_SIGNATURES.values())
    missing = [
        name for name, fn in jitted.items() if id(fn) not in listed and f"{name}(" not in listed_src
    ]
    res = {
        "triton": triton.__version__,
        "target": f"cuda:{args.arch}",
        "kernels": {},
        "helpers": [],
        "missing": missing,
    }
    res["helpers"] = sorted(
        n for n, fn in jitted.items() if id(fn) not in listed and n not in missing
    )
    ok = not missing
    for name in missing:
        print(
            f"[triton-aot] MISSING: @triton.jit {name} is neither in AOT_SIGNATURES nor called by a listed kernel"
        )
    target = GPUTarget("cuda", args.arch, 32)
    for name, (fn, sig, cx) in tk.AOT_SIGNATURES.items():
        t0 = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=target)
            cubin = len(k.asm.get("cubin", b""))
            good = cubin > 0 and f".target sm_{args.arch}" in k.asm.get("ptx", "")
            entry = {
                "cubin_bytes": cubin,
                "ok": good,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        except Exception as e:  # report every kernel, then fail
            entry = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[:2000],
                "seconds": round(time.perf_counter() - t0, 2),
            }
        ok = ok and entry["ok"]
        res["kernels"][name] = entry
        print(
            f"[triton-aot] {name:18s} {'ok' if entry['ok'] else 'FAILED'} {entry['seconds']:6.2f} s "
            f"{entry.get('cubin_bytes', '')} {entry.get('error', '')}"
        )
    res["ok"] = ok
    print(
        f"[triton-aot] triton {triton.__version__}, {len(res['kernels'])} kernels, helpers {res['helpers']}: "
        f"{'ok' if ok else 'FAILED'}"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
