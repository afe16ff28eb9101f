"""What stop() says when a session recorded nothing although the run trained while it was
attached: better said than left for the user to find in empty files."""

from __future__ import annotations

from monitor.session.collection import UNENDED_PASSES


def unseen_updates(updates: int | None, now: int | None, passes: int, stale: int) -> str | None:
    """Why no step was counted: the optimizer went from ``updates`` to ``now`` updates unseen (a
    compiled step runs no hook), the gradients saw ``passes`` backward passes but the optimizer
    given never stepped (one made anew steps unwatched), or ``stale`` monitored parameters are no
    longer the model's; None when none of these holds."""
    if now is not None and updates is not None and now > updates:
        return (
            f"trainmon: the optimizer made {now - updates} update(s) while attached and the monitor saw "
            "none, so nothing was recorded: a compiled step runs no hook (MindSpore graph mode: call "
            "step_end() after each step, as the Model.train callback does; a jit step: "
            "set_monitor(..., graph_mode=True))"
        )
    if 0 < passes < UNENDED_PASSES:  # from UNENDED_PASSES on, it was said during the run
        return (
            f"trainmon: {passes} backward pass(es) while attached, yet the optimizer given to "
            "set_monitor never stepped, so nothing was recorded: is it the one that steps (not one "
            "made anew after set_monitor, say after loading a checkpoint)?"
        )
    if stale:
        return (
            f"trainmon: the optimizer given to set_monitor never stepped and {stale} monitored "
            "parameter(s) are no longer the model's (made anew after set_monitor: sharded, "
            "parallelized or wrapped), so nothing was recorded: build the optimizer and call "
            "set_monitor after fully_shard / parallelize_module"
        )
    return None
