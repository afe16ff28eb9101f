"""msprobe's l2 features on torch: attention probabilities and linear spectral norms (see
``monitor.datatypes.l2`` for what they are and how they differ from msprobe's).

Attention: a forward hook on each listed module computes, on the module's device in float32, the
causal softmax of Q K^T / sqrt(d) of batch 0 (head 0, every head, or each head) and keeps two or
four numbers per call; nothing is copied to the host until the step is written. Linear: at the
optimizer step, 24 Lanczos steps per weight, started from the top singular vector of the last
collected step mixed with a random one; with ``shard_reduce`` a weight held in pieces (FSDP2,
tensor parallelism) is measured whole through its pieces (adapters.torch.sharded.spectral).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Container, Sequence
from typing import Any, Literal

import torch

from adapters.torch.dist import local_tensor
from adapters.torch.lanczos import GramBatches, alone, lanczos, padded, top_eigenpairs
from adapters.torch.micro_steps import MicroSteps
from adapters.torch.sharded.fsdp_internals import FlatSlot
from adapters.torch.sharded.spectral import ShardedWeight, linear_weight, split_dimension
from adapters.torch.sharded.spectral_flat import FlatPieceWeight, flat_weights
from monitor.config.schema import MonitorConfig
from monitor.datatypes.l2 import FIRST_ITERATIONS, WARM_ITERATIONS, L2Steps
from monitor.record import RowSet
from monitor.session.collection import UnendedStep

logger = logging.getLogger("trainmon")


def is_linear(module: torch.nn.Module, flattened: Container[int] = ()) -> bool:
    """A module with a 2-D ``weight`` (or ``wg``) tensor that is not an embedding table; or one
    whose 2-D weight FSDP1 flattened (``flattened``: their ids). FSDP1's wrapper, which forwards
    its module's attributes, is not one: the module it wraps is."""
    if isinstance(module, torch.nn.Embedding) or hasattr(module, "num_embeddings"):
        return False
    if hasattr(module, "vocab_start_index") or hasattr(module, "_fsdp_wrapped_module"):
        return False
    if id(module) in flattened:
        return True
    weight = getattr(module, "weight", None)
    weight = weight if isinstance(weight, torch.Tensor) else getattr(module, "wg", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def _weight_of(module: torch.nn.Module) -> torch.Tensor | None:
    """A linear module's 2-D weight as its attributes hand it on, or None (FSDP1 flattened it)."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def sharded(weight: torch.Tensor) -> bool:
    """A weight this rank holds only a piece of: a DTensor spread over its mesh (FSDP2, tensor
    parallelism; not one replicated on every rank, as ``SequenceParallel`` leaves a module's), an
    empty ZeRO-3 partition, or a Megatron tensor-parallel shard. A piece's singular values are
    not the weight's, so such weights are not measured."""
    return (
        (hasattr(weight, "to_local") and not all(p.is_replicate() for p in weight.placements))
        or weight.numel() == 0
        or bool(getattr(weight, "tensor_model_parallel", False))
    )


def attention_scores(q: torch.Tensor, k: torch.Tensor, order: str, heads: str) -> torch.Tensor:
    """Per head of batch 0: ``[softmax_max, entropy]`` of the causal attention probabilities;
    shape (heads, 2) with 1 head for ``first``. With fewer key than query heads (grouped-query
    attention) query head h reads key head h // (query heads / key heads). One head's (s, s)
    scores exist at a time."""
    if order == "s,b,h,d":
        q, k = q[:, 0], k[:, 0]  # (s, h, d)
    else:
        q, k = q[0], k[0]
    if heads == "first":
        q, k = q[:, :1], k[:, :1]
    elif k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.stack([head_scores(q[:, h].float(), k[:, h].float()) for h in range(q.shape[1])])


def head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[softmax_max, entropy]`` of one head's causal softmax(q k^T / sqrt(d)); q, k (s, d)."""
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    causal = torch.ones(scores.shape, dtype=torch.bool, device=scores.device).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    # 0 - x, not -x: one key alone has entropy 0, not -0
    entropy = 0.0 - (p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(dim=-1).mean()
    return torch.stack([p.amax(dim=-1).mean(), entropy])


def summarise(per_head: torch.Tensor, heads: str) -> torch.Tensor:
    """The rows written for one call: one row (first, all) or one per head (each)."""
    if heads == "all":
        mean = per_head.mean(dim=0)
        return torch.stack([mean[0], mean[1], per_head[:, 0].max(), per_head[:, 1].min()]).unsqueeze(0)
    return per_head


class L2Features(L2Steps):
    """The hooks and per-step values of the l2 features of one collection."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        config: MonitorConfig,
        on_error: Callable[[str, BaseException], None],
        unended: UnendedStep | None = None,
    ) -> None:
        named = [
            (vpp, raw, module) for vpp, chunk in enumerate(chunks) for raw, module in chunk.named_modules()
        ]
        flattened = flat_weights(chunks)  # FSDP1: where each flattened 2-D weight lies
        super().__init__(
            named, config, functools.partial(is_linear, flattened=flattened), on_error, _weight_of
        )
        self.chunks = list(chunks)
        self.micro = MicroSteps(self.chunks, lambda: self.collect, unended, super().reset)
        #: per linear module held in pieces (shard_reduce): how its weight lies across the ranks
        self._pieces: dict[int, ShardedWeight | FlatPieceWeight] = {}
        whole = []
        for entry in self.linear:
            layout = _piece_layout(entry[2], flattened.get(id(entry[2])), config.shard_reduce)
            if layout is not False:
                if layout is not None:
                    self._pieces[len(whole)] = layout
                whole.append(entry)
        if len(whole) < len(self.linear):
            logger.warning(
                "trainmon: linear_hook: %d of %d linear weights are sharded across ranks (FSDP, "
                "ZeRO-3, tensor parallelism) and are not measured: a piece's spectral norm is not the "
                "weight's%s",
                len(self.linear) - len(whole),
                len(self.linear),
                ""
                if config.shard_reduce
                else " (with shard_reduce, FSDP's and DTensor weights are measured whole)",
            )
        self.linear = whole
        self._generators: dict[torch.device, torch.Generator] = {}

    def register(self) -> list:
        if not self.attention:
            return []
        handles = self.micro.register()
        for index, (_, _, module) in enumerate(self.attention):
            handles.append(module.register_forward_hook(self._hook(index)))
        return handles + self.micro.register_ends()

    def _hook(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self.micro.records(module, self.attention[index][0], args):
                self._measure(index, args)

        return hook

    def _measure(self, index: int, args: tuple) -> None:
        """One call's rows, unless the call is a checkpoint's recompute in the backward pass."""
        if torch._C._current_graph_task_id() != -1:
            return
        try:
            tensors = [a for a in args if isinstance(a, torch.Tensor)][:2]
            if not self.usable_qk(index, [t.shape for t in tensors]):
                return
            with torch.no_grad():
                q, k = tensors[0].detach(), tensors[1].detach()
                rows = summarise(attention_scores(q, k, self.order, self.heads), self.heads)
            self.add_attention(index, self.micro.of(self.attention[index][0]), rows, rows.shape[0])
        except Exception as exc:
            self.attention_failed(index, exc)

    def reset(self) -> None:
        super().reset()
        self.micro.reset()

    def _generator(self, device: torch.device) -> torch.Generator:
        """This monitor's own random numbers on ``device`` (the training's generators are never
        drawn from)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(0)
        return self._generators[device]

    def take_attention(self, rank: int) -> tuple[RowSet, torch.Tensor] | None:
        """This step's attention rows and values (on the device); None without any. Resets the step."""
        return self.take_rows(rank, lambda values: torch.cat(values).float())

    def linear_values(self, rank: int) -> tuple[RowSet, torch.Tensor] | None:
        """``[kernel_norm, sr]`` of every linear module's weight now; None without any. Whole
        weights whose Gram matrices have one size run Lanczos as one batch (``GramBatches``), a
        weight held in pieces alone (its products are collectives); the tridiagonal
        eigenproblems of all weights are solved together, on their device."""
        if not self.linear:
            return None
        count = len(self.linear)
        frobenius: list[torch.Tensor] = [torch.zeros(())] * count
        scales: list[torch.Tensor] = [torch.ones(())] * count
        runs: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        batches = GramBatches()
        with torch.no_grad():
            for index, (_, _, module) in enumerate(self.linear):
                layout = self._pieces.get(index)
                if layout is not None:
                    piece = layout.piece(module)
                    frobenius[index] = layout.frobenius(piece)
                    gram = functools.partial(layout.gram, piece)
                    one = functools.partial(alone, gram)
                    runs.append(self._lanczos([index], one, layout.size, piece.device))
                    continue
                weight = linear_weight(module)
                weight = local_tensor(weight) if hasattr(weight, "to_local") else weight  # a replica
                copied = weight.dtype != torch.float32
                weight = weight.detach().float()
                frobenius[index] = torch.linalg.vector_norm(weight)
                # Lanczos on the weight over its Frobenius norm: unscaled, the norms of Gram
                # products overflow float32 once the spectral norm passes about 4e9
                scales[index] = torch.nan_to_num(frobenius[index], nan=1.0, posinf=1.0).clamp_min(1e-30)
                size = min(weight.shape)
                key = (weight.device, size, self._warm(index, size, weight.device))
                for (device, size, _), batch in batches.add(key, index, weight, scales[index], copied):
                    runs.append(self._lanczos(batch.indices, batch, size, device))
            for (device, size, _), batch in batches.close():
                runs.append(self._lanczos(batch.indices, batch, size, device))
            sigma = self._spectral_norms(runs, count)
            sigma = sigma * torch.stack([scale.to(sigma.device) for scale in scales])
            frobenius = torch.stack([f.to(sigma.device) for f in frobenius])
            # a weight holding NaN gives NaN; one holding Inf, or whose squares overflow float32
            # (a norm above 1.8e19), inf and an undefined ratio
            finite = torch.isfinite(frobenius)
            sigma = torch.where(finite, sigma, frobenius)
            ratio = torch.where(sigma == 0, 0.0, frobenius / sigma)  # a zero weight: 0
        return self.linear_rows(rank), torch.stack([sigma, ratio], dim=1)

    def _warm(self, index: int, size: int, device: torch.device) -> bool:
        """Whether the weight has a top vector of the last collected step to start from."""
        last = self.vectors.get(index)
        return last is not None and last.shape[0] == size and last.device == device

    def _lanczos(
        self,
        indices: list[int],
        gram: Callable[[torch.Tensor], torch.Tensor],
        size: int,
        device: torch.device,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Lanczos on the Gram matrices (``gram``, of ``size``, on ``device``) of the weights
        ``indices``, each started from its last step's top Ritz vector plus a random one (random
        alone the first time, for the whole batch)."""
        start = torch.randn(len(indices), size, generator=self._generator(device), device=device)
        steps = FIRST_ITERATIONS
        if all(self._warm(index, size, device) for index in indices):
            # half the last top vector, half a random one (see monitor.datatypes.l2)
            last = torch.stack([self.vectors[index] for index in indices])
            norms = torch.linalg.vector_norm(last, dim=1, keepdim=True).clamp_min(1e-30)
            start = last / norms + start / math.sqrt(size)
            steps = WARM_ITERATIONS
        basis, tridiagonal = lanczos(gram, start, min(steps, size))
        return indices, basis, tridiagonal

    def _spectral_norms(
        self, runs: list[tuple[list[int], torch.Tensor, torch.Tensor]], count: int
    ) -> torch.Tensor:
        """The largest singular value of each of ``count`` weights from the Lanczos runs, all
        tridiagonals in one batch per device (padded with zeros, which add only zero
        eigenvalues); keeps each top Ritz vector for the next step."""
        by_device: dict[torch.device, list[int]] = {}
        for k, (_, basis, _) in enumerate(runs):
            by_device.setdefault(basis.device, []).append(k)
        sigma: list[torch.Tensor] = [torch.zeros(())] * count
        for chosen in by_device.values():
            width = max(runs[k][2].shape[1] for k in chosen)
            values, vectors = top_eigenpairs(torch.cat([padded(runs[k][2], width) for k in chosen]))
            values = values.clamp_min(0).sqrt()
            row = 0
            for k in chosen:
                indices, basis, _ = runs[k]
                steps = basis.shape[1]
                tops = torch.bmm(vectors[row : row + len(indices), None, :steps], basis)[:, 0]
                # a NaN weight gives NaN now, not a NaN start for every later step
                tops = torch.nan_to_num(tops, nan=1.0, posinf=1.0, neginf=-1.0)
                for offset, index in enumerate(indices):
                    self.vectors[index] = tops[offset]
                    sigma[index] = values[row + offset]
                row += len(indices)
        first = runs[0][1].device  # the values go where the first run's are
        return torch.stack([s.to(first) for s in sigma])


def _piece_layout(
    module: torch.nn.Module, slot: FlatSlot | None, shard_reduce: bool
) -> ShardedWeight | FlatPieceWeight | Literal[False] | None:
    """How the module's weight is measured: None whole here; with ``shard_reduce``, through its
    pieces (an FSDP1 ``slot`` of the flattened weight, or a DTensor split along its rows, columns
    or both); False not at all (a piece of something else: its spectral norm is not the weight's)."""
    if slot is not None:
        return FlatPieceWeight(slot) if shard_reduce else False
    weight = linear_weight(module)
    if not sharded(weight):
        return None
    split = split_dimension(weight) if shard_reduce else None
    return False if split is None else ShardedWeight(weight, split)
