"""What a collection says, once each, when a step's micro-batches do not match ``grad_acc_steps``:
the step's gradient sum was lost because the optimizer freed its first micro-batch's gradient,
taken for the last, before another came (DeepSpeed), rows are missing because the gradients
changed before the optimizer step, or merely another count (a shorter last step of an epoch,
whose activations and gradients the rules then leave to the NaN/Inf check)."""

from __future__ import annotations

import logging

logger = logging.getLogger("trainmon")


def micro_batch_message(
    told: set[str],
    step: int,
    micro_batches: int,
    expected: int | None,
    missing: int,
    unsummed: int,
    per_micro_batch: bool,
) -> tuple[int, str] | None:
    """The log level and text of the first of those not yet ``told`` that applies to the step
    (its key is then added to ``told``), or None."""
    if _first_time(told, "unsummed micro-batches", bool(unsummed)):
        return logging.WARNING, (
            f"trainmon: grad_unreduced: step {step} had {micro_batches} micro-batches, grad_acc_steps "
            f"is {expected}, and the optimizer frees each micro-batch's gradient once reduced "
            "(DeepSpeed ZeRO-2/3, or with fp32 gradient accumulation): the first micro-batch was "
            f"taken for the step's last and not kept, so the rows of {unsummed} parameters are "
            "missing at this step; from now on every micro-batch is summed. Pass the engine's "
            "gradient_accumulation_steps() as grad_acc_steps."
        )
    if _first_time(told, "missing micro-batch rows", bool(missing)):
        return logging.WARNING, (
            f"trainmon: grad_unreduced: step {step} ended after {micro_batches} micro-batch(es), "
            f"grad_acc_steps is {expected}, and the gradients of {missing} parameters changed before "
            "the optimizer step (clipping or a reduction), so their rows are missing at this step; from "
            "now on every micro-batch's accumulated gradient is measured. In a loop of your own, call "
            "mon.set_last_micro_batch(True) before the backward of each step's last micro-batch (False "
            "before the others), or use DDP's no_sync for the micro-batches before the last; the "
            "trainer callbacks do this."
        )
    if _first_time(told, "micro-batch count", bool(micro_batches and expected and micro_batches != expected)):
        described = (
            "has a row per micro-batch it had"
            if per_micro_batch
            else f"describes the gradient accumulated over the {micro_batches} it had"
        )
        return logging.INFO, (
            f"trainmon: step {step} had {micro_batches} micro-batch(es), grad_acc_steps is {expected}; "
            f"grad_unreduced {described} (said once)"
        )
    return None


def uneven_step(told: set[str], step: int, counted: int, expected: int | None, previous: int | None) -> bool:
    """Whether a step of ``counted`` micro-batches is shorter than ``expected`` and than the
    ``previous`` collected step (an epoch's shorter last step): what one micro-batch carries,
    and the gradients' sum, then scale with how the loop normalises its loss (by the step's
    tokens, as the Hugging Face Trainer does, or by grad_acc_steps), so the rules would take it
    for a fault; said once. Every step as short as the one before (grad_acc_steps not what the
    loop does) is judged as usual."""
    uneven = bool(expected) and 0 < counted < expected and (previous is None or counted < previous)
    if _first_time(told, "uneven judged", uneven):
        logger.info(
            "trainmon: the rules judge step %d's activations and gradients for NaN/Inf only: a step "
            "shorter than grad_acc_steps (%d) carries them at another scale, which depends on how "
            "the loss is normalised (said once)",
            step,
            expected,
        )
    return uneven


def _first_time(told: set[str], key: str, applies: bool) -> bool:
    """Whether a message that ``applies`` is said now: not ``told`` before (it is from now on)."""
    if not applies or key in told:
        return False
    told.add(key)
    return True
