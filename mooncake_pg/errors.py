"""Errors of the ``mooncake`` process group."""

from __future__ import annotations

import torch.distributed as dist


class RankFailureError(dist.DistBackendError):
    """An op could not complete because ranks failed.

    Attributes:
        failed_ranks: the ranks agreed failed (through the control store; the same on
            every survivor).
        epoch: the membership epoch that records the failure.
    """

    def __init__(self, message: str, failed_ranks=(), epoch: int = 0):
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.epoch = int(epoch)

    def __reduce__(self):
        return (type(self), (str(self), self.failed_ranks, self.epoch))


class RankFencedError(RankFailureError):
    """This rank was declared failed by its peers and has fenced itself.

    It was too slow or cut off; its group is unusable; it may rejoin as a recovering rank.
    """
