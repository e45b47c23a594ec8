"""Weight sync from trainers to rollout workers: :class:`WeightSync` through the store
(``sync.py``, the store layout it writes; ``publish.py``, ``pull.py``, ``relay.py``) and
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
