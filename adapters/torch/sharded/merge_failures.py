"""A fault of ours on one rank must not stop the others in a merge's collective.

With ``shard_reduce`` every rank all-gathers each merged data type's pieces at every collected
step. A rank whose part failed (and was switched off there, as any failure is) would leave its
mates waiting in that gather: gloo aborts the process on the mismatched collective, NCCL hangs.
So whatever fails, the rank still joins the part's gather: at the step it failed, or at the next
one if it had gathered already, saying that it failed (``shard_reduce(..., failed=True)``). Every rank
of the merge then raises ``PeerFailed`` at that same gather, and the part is switched off
everywhere at one step; the training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from adapters.torch.dist import collective_device
from adapters.torch.sharded.shards import GatheredThenFailed, PeerFailed, shard_reduce

logger = logging.getLogger("trainmon")

#: the parts whose rows shard_reduce merges at every collected step, in this order of the step
MERGED_PARTS = ("grad_reduced", "other", "param_origin", "exp_avg", "exp_avg_sq", "param_updated")


class MergeFailures:
    """Runs the merged parts so that a failure on one rank reaches the merge's other ranks.

    Args:
        group: the shard group (or tuple of mesh groups) the parts merge over.
        rows: each part's number of rows (the shape of its gather, with its ops).
        ops: the statistics merged (mg_direction merges its share alone, as a mean).
        fail: switches a part off on this rank (logged once).
    """

    def __init__(
        self,
        group: Any,
        rows: Mapping[str, int],
        ops: tuple[str, ...],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.group, self._rows, self._ops, self._fail = group, rows, ops, fail
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
            self._fail(part, exc.with_traceback(None))  # the cause's traceback is the failing rank's
        except GatheredThenFailed as exc:
            self._owed.add(part)
            self._fail(part, exc.__cause__ or exc)
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
        ops = ("mean",) if part == "other" else self._ops
        device, rows = collective_device(), self._rows[part]
        matrix = torch.full((rows, len(ops)), float("nan"), dtype=torch.float64, device=device)
        try:
            shard_reduce(matrix, torch.zeros(rows, dtype=torch.float64, device=device), ops, self.group, True)
        except PeerFailed:
            pass  # the verdict this rank sent itself
        except Exception as exc:  # the gather itself failed: nothing more this rank can do
            logger.error("trainmon: %s: telling the other ranks of its failure failed (%r)", part, exc)
