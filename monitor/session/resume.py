"""Where a resumed run's steps go on from: the step its loaded state was saved at, where the
loop did not number them itself (``set_monitor(..., start_iteration=N)``)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("trainmon")


def restore_step(session: Any, step: Any, numbered: bool) -> None:
    """Renumber ``session``'s steps from the saved ``step`` before any has ended, unless the loop
    ``numbered`` them (said where the numbers disagree); nothing on a rank that records nothing."""
    if type(step) is not int or step <= 0 or session.collection is None or step == session.step:
        return
    if not numbered and session.renumber(step):
        logger.info(
            "trainmon: steps go on from %d, the step the loaded state was saved at (not from 0)", step
        )
        return
    logger.warning(
        "trainmon: load_state_dict: the state was saved at step %d, but steps here go on from %d "
        "(start_iteration, or steps already counted since set_monitor); they keep that numbering",
        step,
        session.step,
    )
