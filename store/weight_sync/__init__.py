"""Weight sync from trainers to rollout workers: through the store, or over a process group.

:class:`WeightSync` goes through the store (``sync.py``, with the store layout it writes; composed
of ``records.py``, ``publish.py`` and ``pull.py``, whose relays across hosts are ``relay.py``) and
:class:`GroupWeightSync` over a process group (``group.py``).
"""

from .common import GroupSyncResult, PublishResult, PullResult, tensor_digest
from .config import WeightSyncConfig
from .group import GroupWeightSync
from .sync import WeightSync

__all__ = [
    "GroupSyncResult",
    "GroupWeightSync",
    "PublishResult",
    "PullResult",
    "WeightSync",
    "WeightSyncConfig",
    "tensor_digest",
]
