"""Configuration of ``mooncake_ep``.

Every ``MOONCAKE_EP_*`` environment variable the package reads is read here, in
:func:`env_defaults`; explicit arguments always win over the environment.

| variable | meaning | default |
|---|---|---|
| ``MOONCAKE_EP_KERNELS`` | ``auto`` (Triton for CUDA tensors when importable, torch ops otherwise) / ``torch`` / ``triton`` (Triton for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1``) | ``auto`` |
| ``MOONCAKE_EP_FP32_ACCUMULATE`` | ``1``: 16-bit combines accumulate in float32 and round once; ``0``: accumulate in the data's dtype (faster on CPU) | ``1`` |
| ``MOONCAKE_EP_HIERARCHICAL`` | ``1``: in a group that spans hosts, a normal-mode dispatch sends a token over a host link once per remote host and forwards it inside the host (combine sums inside the host first); ``0``: rank to rank | ``1`` |
| ``MOONCAKE_EP_LOW_LATENCY_BACKEND`` | how the low-latency ops move rows: ``auto`` (NVSHMEM when usable on every rank, else the process group) / ``nvshmem`` (NVSHMEM or ``ValueError``) / ``group`` (the process group's ``all_to_all_single``) | ``auto`` |
"""

from __future__ import annotations

import dataclasses
import operator
import os

from mooncake_pg.config import LazyEnv, bool_env

_KERNELS = ("auto", "torch", "triton")
_LL_BACKENDS = ("auto", "nvshmem", "group")


@dataclasses.dataclass(kw_only=True)
class EPConfig:
    """Options of a :class:`mooncake_ep.Buffer` (keyword-only).

    Attributes:
        kernels: ``"auto"`` (Triton kernels for CUDA tensors when Triton is importable,
            vectorized torch ops otherwise), ``"torch"`` or ``"triton"``
            (``MOONCAKE_EP_KERNELS``). With ``"triton"``, CPU tensors run the Triton kernels
            under Triton's interpreter when ``TRITON_INTERPRET=1`` is set (before triton is
            imported); otherwise CPU tensors use torch ops.
        fp32_accumulate: combines of bfloat16/float16 data sum in float32 and round once
            (``MOONCAKE_EP_FP32_ACCUMULATE``, default ``True``); ``False`` sums in the data's
            own dtype (one rounding per partial sum; on CPU no faster than the C++ kernel
            that sums in float32).
        hierarchical: in a group that spans hosts (a ``mooncake`` group whose ranks
            :func:`mooncake_pg.get_rank_hosts` puts on several hosts), normal-mode
            ``dispatch``, ``combine``, cached dispatches and their backward passes move
            a token's rows over a host link at most once per remote host: to one relay
            rank there, which forwards them to the host's ranks that need them, and
            combine sums a token's rows inside each host before one row per (token,
            host) goes back (:mod:`mooncake_ep._hosts`; ``MOONCAKE_EP_HIERARCHICAL``,
            default ``True``). ``False``: one row per (token, rank) rank to rank. Must
            agree across ranks (the dispatch header checks it).
        max_membership_retries: how many times a normal-mode ``dispatch`` restarts when the
            group's membership epoch changes while it runs (``on_failure="mask"``): an int
            >= 0, or ``None`` for the world size.
        low_latency_backend: how ``low_latency_dispatch``/``low_latency_combine`` (and their
            backward passes) move rows (``MOONCAKE_EP_LOW_LATENCY_BACKEND``, default
            ``"auto"``). ``"nvshmem"``: one-sided puts into NVSHMEM symmetric buffers
            (needs CUDA tensors, ``nvshmem.core`` from ``nvshmem4py-cu13`` importable and
            every rank of the group active; otherwise the op raises ``ValueError`` on every
            rank before any token moves). ``"group"``: the process group's
            ``all_to_all_single``. ``"auto"``: NVSHMEM when it is usable on every rank,
            the group otherwise (silently; ``Buffer.low_latency_backend`` says which ran).
    """

    kernels: str | None = None
    fp32_accumulate: bool | None = None
    hierarchical: bool | None = None
    max_membership_retries: int | None = None
    low_latency_backend: str | None = None

    def __post_init__(self):
        if self.kernels is not None and self.kernels not in _KERNELS:
            raise ValueError(f"EPConfig: kernels must be one of {_KERNELS}, got {self.kernels!r}")
        if self.low_latency_backend is not None and self.low_latency_backend not in _LL_BACKENDS:
            raise ValueError(
                f"EPConfig: low_latency_backend must be one of {_LL_BACKENDS}, "
                f"got {self.low_latency_backend!r}"
            )
        for name in ("fp32_accumulate", "hierarchical"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"EPConfig: {name} must be a bool or None, got {v!r}")
        n = self.max_membership_retries
        if n is not None:
            if isinstance(n, bool) or not hasattr(n, "__index__") or operator.index(n) < 0:
                raise ValueError(
                    f"EPConfig: max_membership_retries must be an int >= 0 or None, got {n!r}"
                )
            self.max_membership_retries = operator.index(n)


def _kernels_env(env) -> str:
    kernels = env.get("MOONCAKE_EP_KERNELS", "auto") or "auto"
    if kernels not in _KERNELS:
        raise ValueError(f"MOONCAKE_EP_KERNELS must be one of {_KERNELS}, got {kernels!r}")
    return kernels


def _ll_env(env) -> str:
    ll = env.get("MOONCAKE_EP_LOW_LATENCY_BACKEND") or "auto"  # exact, as MOONCAKE_EP_KERNELS
    if ll not in _LL_BACKENDS:
        raise ValueError(
            f"MOONCAKE_EP_LOW_LATENCY_BACKEND must be one of {_LL_BACKENDS}, "
            f"got {env.get('MOONCAKE_EP_LOW_LATENCY_BACKEND')!r}"
        )
    return ll


# setting -> how it is read from the environment (each variable in one place)
_FROM_ENV = {
    "kernels": _kernels_env,
    "fp32_accumulate": lambda env: bool_env(env, "MOONCAKE_EP_FP32_ACCUMULATE", True),
    "hierarchical": lambda env: bool_env(env, "MOONCAKE_EP_HIERARCHICAL", True),
    "low_latency_backend": _ll_env,
}


def env_defaults() -> dict:
    """``mooncake_ep``'s settings from ``MOONCAKE_EP_*`` variables (the only place they are read).

    Raises ``ValueError`` naming a malformed variable.
    """
    return {k: read(os.environ) for k, read in _FROM_ENV.items()}


def resolve(cfg: EPConfig | None, world_size: int) -> dict:
    """Explicit options over the environment; plain values."""
    if cfg is not None and not isinstance(cfg, EPConfig):
        raise TypeError(
            f"mooncake_ep: config must be an EPConfig or None, got {type(cfg).__name__}"
        )
    cfg = cfg or EPConfig()
    env = LazyEnv(_FROM_ENV)
    return {
        "kernels": cfg.kernels or env["kernels"],
        "fp32_accumulate": env["fp32_accumulate"]
        if cfg.fp32_accumulate is None
        else bool(cfg.fp32_accumulate),
        "hierarchical": env["hierarchical"] if cfg.hierarchical is None else cfg.hierarchical,
        "max_membership_retries": world_size
        if cfg.max_membership_retries is None
        else int(cfg.max_membership_retries),
        "low_latency_backend": cfg.low_latency_backend or env["low_latency_backend"],
    }
