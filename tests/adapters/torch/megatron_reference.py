"""The independent side of the Megatron tests: what the numbers must be, computed without the monitor.

- each rank's accumulated gradient from a plain-torch replica of the chunks (fp32 sums of the
  micro-batch gradients, as Megatron's ``main_grad`` accumulates);
- the reduced gradient as the mean of all ranks' replica gradients (all_gather);
- values and moments from Megatron's own handles (the parameter, ``param.main_param``, the
  DistributedOptimizer's ``_get_model_param_range_map`` / ``_get_main_param_and_optimizer_states``),
  with the ranks' pieces gathered into whole tensors where needed;

and the Megatron-style training step both the monitored and the unmonitored model run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist


def forward(modules, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x.float().pow(2).mean()


def train_step(chunks, optimizer, batches) -> None:
    """One Megatron-style step: accumulate micro-batches, finish the grad sync, step."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for micro, x in enumerate(batches):
        with contextlib.ExitStack() as stack:
            if micro < len(batches) - 1:
                for chunk in chunks:
                    stack.enter_context(chunk.no_sync())
            forward(chunks, x).backward()
    for chunk in chunks:
        chunk.finish_grad_sync()


def local_grads(chunks, replicas, batches) -> dict:
    """Each parameter's gradient over this rank's micro-batches, from a plain replica, in fp32."""
    for chunk, replica in zip(chunks, replicas):
        replica.load_state_dict(chunk.module.state_dict())
    total = {}
    for x in batches:
        for replica in replicas:
            replica.zero_grad()
        forward(replicas, x).backward()
        for c, replica in enumerate(replicas):
            for name, p in replica.named_parameters():
                key = (c, name)
                total[key] = total[key] + p.grad.float() if key in total else p.grad.float()
    return {key: value.numpy().astype(np.float64) for key, value in total.items()}


def mean_over_ranks(local: dict) -> dict:
    keys = sorted(local)
    flat = torch.cat([torch.from_numpy(local[k]).reshape(-1) for k in keys])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    mean = torch.stack(gathered).mean(dim=0).numpy()
    out, offset = {}, 0
    for k in keys:
        size = local[k].size
        out[k] = mean[offset : offset + size].reshape(local[k].shape)
        offset += size
    return out


def truth(spec: dict, chunks, optimizer) -> dict:
    """Per parameter, this rank's (start, end, value, exp_avg, exp_avg_sq) from Megatron's handles."""
    pieces = {}
    for c, (chunk, part) in enumerate(zip(chunks, _parts(optimizer, len(chunks)))):
        for name, p in chunk.module.named_parameters():
            inner = part.optimizer
            if spec["dist_opt"]:
                if p not in part.model_param_gbuf_map:
                    continue
                span = part._get_model_param_range_map(p)["param"]
                tensors = part._get_main_param_and_optimizer_states(p)
                start, end, value = span.start, span.end, tensors["param"]
                state = tensors
            else:
                master = p.main_param if spec["bf16"] else p
                start, end, value, state = 0, p.numel(), master, inner.state.get(master, {})
            pieces[(c, name)] = tuple(
                [start, end]
                + [
                    None if t is None else t.detach().float().reshape(-1).numpy().astype(np.float64).copy()
                    for t in (value, state.get("exp_avg"), state.get("exp_avg_sq"))
                ]
            )
    return pieces


def _parts(optimizer, n_chunks: int) -> list:
    parts = optimizer.chained_optimizers
    return parts if len(parts) == n_chunks else parts * n_chunks


def gather_whole(pieces: dict, numel: dict) -> dict:
    """Whole (value, exp_avg, exp_avg_sq) assembled from every rank's pieces (all_gather_object)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    whole = {}
    for key, size in numel.items():
        parts = sorted((p[key] for p in everyone if key in p), key=lambda piece: piece[0])
        assert [p[0] for p in parts] == [0] + [p[1] for p in parts[:-1]] and parts[-1][1] == size, key
        whole[key] = tuple(
            None if parts[0][j] is None else np.concatenate([p[j] for p in parts]) for j in (2, 3, 4)
        )
    return whole


def agreement(grad: np.ndarray, moment: np.ndarray | None) -> float:
    if moment is None:
        return 1.0
    return float(((np.sign(grad) * np.sign(moment)).sum() / moment.size + 1) / 2)
