"""Two real gloo ranks under torch DDP, fed different data, with ``no_sync`` on all micro-batches
of a step but the last; one step is shorter than grad_acc_steps.

The unreduced gradient must be each rank's own (it differs between ranks and equals a
single-process replica trained on that rank's data); the reduced gradient is DDP's average,
equal on both ranks. Every statistic is checked against numpy on copies made in the worker.
With DDP's defaults the gradients are measured together at the backward pass's end, before DDP
writes its reduction back; with the gradients as views of DDP's buckets (reduced in place during
the pass) or a static graph (reduced from a callback queued before the pass's first gradient),
each is measured in its own hook: both give the rank's own gradient. The same holds when the
monitor is given the model inside the DDP wrapper rather than the wrapper.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import ALL_OPS, MLP, assert_stats_close, make_batches
from tests.log_capture import trainmon_records

#: what is said when DDP reduces a micro-batch that is not the step's last
SYNCED_EARLY = "DDP reduced a micro-batch before the step's last"

pytestmark = pytest.mark.distributed

STEPS, GRAD_ACC = 3, 2
#: micro-batches per step: the second is a short last step of an epoch, synchronised at once.
MICRO_BATCHES = (2, 1, 2)


def _worker(rank: int, world_size: int, workdir: str) -> None:
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "out")
    torch.manual_seed(0)
    model = MLP()
    replica = MLP()
    replica.load_state_dict(model.state_dict())
    options = json.loads(os.environ.get("DDP_OPTIONS", "{}"))
    attach_inner = options.pop("attach_inner", False)
    ddp = DistributedDataParallel(model, **options)
    # a static graph cannot take steps of different lengths: one micro-batch a step there
    micro_batches = (1,) * STEPS if options.get("static_graph") else MICRO_BATCHES
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    mon = TrainerMon(
        {
            "wg_distribution": True,
            "mv_distribution": True,
            "param_distribution": True,
            "mg_direction": True,
            "ops": ALL_OPS,
            "format": "csv",
        }
    )
    mon.set_monitor(model if attach_inner else ddp, grad_acc_steps=max(micro_batches), optimizer=optimizer)
    result = {"unreduced_norm": [], "reduced_norm": []}
    result["at_pass_end"] = mon._session.collection.grads.measure_at_pass_end
    with trainmon_records() as records:
        _train_and_check(rank, mon, model, replica, ddp, optimizer, result, micro_batches)
    result["warnings"] = records.warnings()
    mon.stop()
    result["output_dir"] = mon.output_dir
    save_result(workdir, rank, result)


def _train_and_check(rank, mon, model, replica, ddp, optimizer, result, micro_batches) -> None:
    for step_batches, count in zip(make_batches(STEPS, GRAD_ACC, seed=100 + rank), micro_batches):
        replica.load_state_dict(model.state_dict())
        replica.zero_grad()
        for micro, x in enumerate(step_batches[:count]):
            sync = contextlib.nullcontext() if micro == count - 1 else ddp.no_sync()
            with sync:
                ddp(x).pow(2).mean().backward()
            replica(x).pow(2).mean().backward()
        local = {n: p.grad.numpy().copy() for n, p in replica.named_parameters()}
        reduced = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        origin = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        agreement = {}
        for n, p in model.named_parameters():
            if p in optimizer.state:
                signs = np.sign(p.grad.numpy().astype(np.float64))
                moment = np.sign(optimizer.state[p]["exp_avg"].numpy().astype(np.float64))
                agreement[n] = ((signs * moment).sum() / moment.size + 1) / 2
            else:
                agreement[n] = 1.0
        optimizer.step()
        updated = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        moments = {
            kind: {n: optimizer.state[p][kind].numpy().copy() for n, p in model.named_parameters()}
            for kind in ("exp_avg", "exp_avg_sq")
        }
        optimizer.zero_grad()
        got_reduced, got_unreduced = mon.generate_wgrad_metrics()
        got_params, got_moments = mon.generate_param_metrics(), mon.generate_mv_metrics()
        got_other = mon._session.core.latest.latest("other")
        for name in local:
            tag = f"0:{name}/rank{rank}"  # "module." squashed away
            assert_stats_close(
                got_unreduced[f"{tag}/acc_grad"], local[name], what=f"rank {rank} {name} unreduced"
            )
            assert_stats_close(
                got_reduced[f"{tag}/post_grad"], reduced[name], what=f"rank {rank} {name} reduced"
            )
            assert_stats_close(got_params[f"{tag}/param_origin"], origin[name], what=f"{name} param_origin")
            assert_stats_close(
                got_params[f"{tag}/param_updated"], updated[name], what=f"{name} param_updated"
            )
            for kind, values in moments.items():
                assert_stats_close(got_moments[f"{tag}/{kind}"], values[name], what=f"{name} {kind}")
            assert got_other[f"{tag}/mg_direction"]["mean"] == pytest.approx(agreement[name], abs=1e-12)
        result["unreduced_norm"].append(
            {n: got_unreduced[f"0:{n}/rank{rank}/acc_grad"]["norm"] for n in local}
        )
        result["reduced_norm"].append({n: got_reduced[f"0:{n}/rank{rank}/post_grad"]["norm"] for n in local})


def _worker_without_no_sync(rank: int, world_size: int, workdir: str) -> None:
    """Accumulation as many plain scripts do it: DDP reduces every micro-batch. With
    FORWARD_IN_NO_SYNC set, the forwards before the last run under no_sync() and their backwards
    outside it: DDP decides at the forward, so nothing is reduced early then."""
    forward_only = bool(os.environ.get("FORWARD_IN_NO_SYNC"))
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "out")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(MLP())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    mon = TrainerMon({"wg_distribution": True, "format": "api"})
    mon.set_monitor(ddp, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    with trainmon_records() as records:
        for step_batches in make_batches(STEPS, GRAD_ACC, seed=100 + rank):
            for micro, x in enumerate(step_batches):
                last = micro == len(step_batches) - 1
                with contextlib.nullcontext() if last or not forward_only else ddp.no_sync():
                    loss = ddp(x).pow(2).mean()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    mon.stop()
    save_result(workdir, rank, {"warnings": records.warnings()})


@pytest.mark.parametrize(
    ("options", "at_pass_end"),
    [
        ({}, True),
        ({"gradient_as_bucket_view": True}, False),
        ({"static_graph": True}, False),
        # the model inside the wrapper, as trainers hand it to their callbacks: its wrapper is found
        ({"attach_inner": True}, True),
        ({"attach_inner": True, "gradient_as_bucket_view": True}, False),
    ],
)
def test_unreduced_is_each_ranks_own_and_reduced_is_shared(tmp_path, options, at_pass_end):
    rank0, rank1 = run_ranks(_worker, 2, str(tmp_path), {"DDP_OPTIONS": json.dumps(options)})
    assert rank0["at_pass_end"] is rank1["at_pass_end"] is at_pass_end
    assert not [m for m in rank0["warnings"] + rank1["warnings"] if SYNCED_EARLY in m]
    for step in range(STEPS):
        for name, norm in rank0["unreduced_norm"][step].items():
            assert norm != pytest.approx(rank1["unreduced_norm"][step][name], rel=1e-5)
            assert rank0["reduced_norm"][step][name] == pytest.approx(
                rank1["reduced_norm"][step][name], rel=1e-6
            )
    assert os.path.basename(rank0["output_dir"]).split("-rank")[1].startswith("0-")
    assert os.path.basename(rank1["output_dir"]).split("-rank")[1].startswith("1-")
    with open(os.path.join(rank0["output_dir"], "trainmon_run.json"), encoding="utf-8") as info:
        assert json.load(info)["root_modules"] == ["MLP"]  # the model's class, not its wrapper's
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [os.path.basename(rank0["output_dir"]), os.path.basename(rank1["output_dir"])]
    )


@pytest.mark.parametrize(("forward_in_no_sync", "said"), [(False, 1), (True, 0)])
def test_accumulating_without_no_sync_is_said_once_per_rank(tmp_path, forward_in_no_sync, said):
    env = {"FORWARD_IN_NO_SYNC": "1"} if forward_in_no_sync else {}
    for result in run_ranks(_worker_without_no_sync, 2, str(tmp_path), env):
        assert len([m for m in result["warnings"] if SYNCED_EARLY in m]) == said, result["warnings"]


def _wrapper_search_worker(rank: int, world_size: int, workdir: str) -> None:
    import gc

    from adapters.torch.dist import ddp_wrappers

    model, unwrapped = MLP(), MLP()
    ddp = DistributedDataParallel(model)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    try:  # DDP refuses a module without trainable parameters before it sets .module
        DistributedDataParallel(frozen)
    except RuntimeError as exc:
        kept = exc  # a half-built DDP stays alive through the exception's traceback
    found = ddp_wrappers([model])
    save_result(
        workdir,
        rank,
        {
            "half_built_kept": kept is not None
            and any(
                isinstance(obj, DistributedDataParallel) and "module" not in obj.__dict__.get("_modules", {})
                for obj in gc.get_objects()
            ),
            "found_the_wrapper": found is not None and len(found) == 1 and found[0] is ddp,
            "given_wrapper": ddp_wrappers([ddp]) == [ddp],
            "not_looked_for": ddp_wrappers([model], look_around=False) is None,
            "none_around_a_plain_model": ddp_wrappers([unwrapped]) is None,
        },
    )


def test_the_wrapper_of_a_model_given_from_inside_it_is_found(tmp_path):
    """``ddp_wrappers``: the DDP module around a model is found among the live objects, also next
    to a DDP object whose construction failed; a model in no wrapper, or a search not wanted
    (back-ends that do not reduce through torch's DDP), gives None."""
    (result,) = run_ranks(_wrapper_search_worker, 1, str(tmp_path))
    assert result == {
        "half_built_kept": True,
        "found_the_wrapper": True,
        "given_wrapper": True,
        "not_looked_for": True,
        "none_around_a_plain_model": True,
    }
