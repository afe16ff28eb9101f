"""What a run under an fp16 loss scaler must show, for the DeepSpeed and Megatron tests: each
rank's ``{"skipped", "step", "incidents"}`` with incidents as (onset step, root tag, rule)."""

from __future__ import annotations


def assert_overflows_left_to_scaler(results: list[dict], steps: int, bad_step: int, bad_rank: int) -> None:
    """The scaler skipped several early steps, the monitor counted every step, and the only
    incident is the bad batch's, at its step, rooted at the bad rank's input."""
    for rank, result in enumerate(results):
        assert 2 < result["skipped"] < steps - 2 and result["step"] == steps, result
        if rank == bad_rank:
            (incident,) = result["incidents"]
            assert incident[0] == bad_step and incident[1].endswith(f".input:0/rank{rank}/actv"), incident
            assert incident[2] == "NonFinite"
        else:
            assert result["incidents"] == [], f"rank {rank}: the scaler's overflows are no fault"


def assert_nan_gradient_is_fault(results: list[dict], bad_step: int, bad_rank: int) -> None:
    """Without a dynamic scale the bad batch is an incident on its rank and, through the
    reduction that spread its NaN gradients, on the other rank too."""
    bad, other = results[bad_rank], results[1 - bad_rank]
    assert bad["incidents"][0][0] == bad_step and bad["incidents"][0][2] == "NonFinite"
    # the other rank's forward was clean; its gradients turned NaN through the reduction
    assert other["incidents"] and other["incidents"][0][0] == bad_step
