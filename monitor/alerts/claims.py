"""Claim files: how the ranks of a job that share an output root agree on one message per incident.

Each rank that opens an incident at step S writes its message to
``anomaly_detected/alerts/step{S}/rank{R}`` under the output root. After a short wait the lowest
rank that claimed S delivers, and its message names the root that ranks earliest in the step
among all the claims: a fault on rank 1 that reached rank 0 through the gradient all-reduce is
named on rank 1, where it began, not by rank 0's reduced gradients that carried it. Claims older
than the session, or than ``CLAIM_MAX_AGE_S``, belong to an earlier run or incident in the same
root and are not read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from monitor.anomaly.ordering import phase_of, place_in_step
from monitor.files import FILE_MODE, make_private_dir

Message = dict[str, Any]

#: claims older than this belong to an earlier incident (the ranks of one incident find it
#: within seconds of each other).
CLAIM_MAX_AGE_S = 120.0


def write_claim(claims: str, root: str, rank: int, message: Message) -> None:
    """Claim the message's step for ``rank``: written whole (a temporary file renamed), so a peer
    reads the complete message or none."""
    directory = make_private_dir(os.path.join(claims, f"step{message['step']}"), under=root)
    path = os.path.join(directory, f"rank{rank}")
    temporary = os.path.join(directory, f".rank{rank}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        os.write(fd, json.dumps(message, allow_nan=False, default=str).encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(temporary, path)


def read_claims(directory: str, since: float) -> dict[int, Message | None]:
    """Rank -> its claimed message (None where unreadable) of the claims in ``directory`` written
    after ``since`` (wall-clock seconds) and within ``CLAIM_MAX_AGE_S``."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return {}
    oldest = max(since, time.time() - CLAIM_MAX_AGE_S)
    claims: dict[int, Message | None] = {}
    for entry in entries:
        if not (entry.name.startswith("rank") and entry.name[4:].isdigit()):
            continue
        try:
            if entry.stat().st_mtime < oldest:
                continue
            with open(entry.path, encoding="utf-8") as handle:
                message = json.load(handle)
        except OSError:
            continue
        except ValueError:
            message = None
        claims[int(entry.name[4:])] = message if isinstance(message, dict) else None
    return claims


def job_message(own: Message, rank: int, claims: dict[int, Message | None]) -> Message:
    """What the delivering rank sends: of its own message and the ranks' claimed ones, the one
    whose root ranks earliest in the step (then in the causal phase, a local gradient before
    the reduced one measured at the same place; then the lowest rank), with ``ranks``, every
    rank whose incident began at this step, and ``delivered_by``."""
    messages = {**{r: m for r, m in claims.items() if m is not None}, rank: own}

    def place(item: tuple[int, Message]) -> tuple:
        r, message = item
        tag = str(message.get("tag") or "")
        return (*place_in_step(tag, int(message.get("micro_step") or 0)), phase_of({"tag_name": tag}), r)

    root_rank, chosen = min(messages.items(), key=place)
    ranks = sorted({*claims, rank})
    message = {**chosen, "ranks": ranks, "delivered_by": rank}
    if len(ranks) > 1:
        message["summary"] = (
            f"{chosen['summary']} (incidents began at this step on ranks "
            f"{', '.join(map(str, ranks))}; rank {root_rank}'s root comes first in the step)"
        )
    return message
