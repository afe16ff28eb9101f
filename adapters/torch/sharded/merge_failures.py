"""A fault of ours on one rank must not stop the others in a merge's collective.

With ``shard_reduce`` every rank all-gathers each merged data type's pieces at every collected
step. A rank whose part failed (and was switched off there, as any failure is) would leave its
mates waiting in that gather: gloo aborts the process on the mismatched collective, NCCL hangs.
So whatever fails, the rank still joins the part's gather: at the step it failed, or at the next
one if it had gathered already, with its rows marked failed (``shards.failed_rows``). Every rank
of the merge then raises ``PeerFailed`` at that same gather, and the part is switched off
everywhere at one step; the training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from adapters.torch.dist import collective_device
from adapters.torch.sharded.shards import PeerFailed, failed_rows, shard_reduce

logger = logging.getLogger("trainmon")

#: the parts whose rows shard_reduce merges at every collected step, in this order of the step
MERGED_PARTS = ("grad_reduced", "other", "param_origin", "exp_avg", "exp_avg_sq", "param_updated")


class MergeFailures:
    """Runs the merged parts so that a failure on one rank reaches the merge's other ranks.

    Args:
        group: the shard group (or tuple of mesh groups) the parts merge over.
        shape_of: a part's gather: its rows and the ops of its statistics columns.
        fail: switches a part off on this rank (logged once).
    """

    def __init__(
        self,
        group: Any,
        shape_of: Callable[[str], tuple[int, tuple[str, ...]]],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.group, self._shape_of, self._fail = group, shape_of, fail
        self._gathered: set[str] = set()
        self._owed: set[str] = set()

    def gathered(self, part: str) -> None:
        """The part's gather of this step is done (called right after it)."""
        self._gathered.add(part)

    def run(self, part: str, submit: Callable, *args: Any) -> None:
        """``submit(*args)``, the part's collection; on a failure the part is switched off here
        and the others learn of it at this gather or the next."""
        self._gathered.discard(part)
        try:
            submit(*args)
        except PeerFailed as exc:  # every rank of the merge saw it at the same gather
            self._fail(part, exc)
        except Exception as exc:
            if part in self._gathered:
                self._owed.add(part)
            else:
                self._tell(part)
            self._fail(part, exc)

    def pay(self, part: str) -> None:
        """Where the part's gather comes in the step: join it, marked failed, if this rank failed
        after its gather last time (its mates do not know yet)."""
        if part in self._owed:
            self._owed.discard(part)
            self._tell(part)

    def _tell(self, part: str) -> None:
        rows, ops = self._shape_of(part)
        matrix, counts = failed_rows(rows, len(ops), collective_device())
        try:
            shard_reduce(matrix, counts, ops, self.group)
        except PeerFailed:
            pass  # the verdict this rank sent itself
        except Exception as exc:  # the gather itself failed: nothing more this rank can do
            logger.error("trainmon: %s: telling the other ranks of its failure failed (%r)", part, exc)
