"""Lanczos on the Gram matrices of linear weights, on their device without a host sync: the
spectral norms of the l2 features (``adapters.torch.l2``). Whole weights whose Gram matrices
share a size run as one batch (``GramBatches``); a weight held in pieces runs alone, its
products being collectives (``alone``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from monitor.datatypes.l2 import BREAKDOWN

#: whole weights whose Lanczos runs as one batch, at most
BATCH_WEIGHTS = 64
#: float32 copies (of weights held in another type) that the open batches keep, at most, in bytes
COPY_BYTES = 256 << 20


def lanczos(
    apply: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` Lanczos steps with full reorthogonalisation on a batch of symmetric positive
    semi-definite operators of one size, on their device without a host sync: ``apply`` maps
    (b, n) to (b, n), one vector per operator, from ``start`` (b, n); returns the bases
    (b, steps, n) and the tridiagonals (b, steps, steps) whose top eigenpairs give the
    operators' (``top_eigenpairs``). The recurrence runs once for the whole batch: on a CPU, a
    model's linear weights are small enough that each operation's dispatch, not its arithmetic,
    is most of the cost.

    Lanczos converges on the top eigenvalue far faster than power iteration when the largest
    eigenvalues lie close together (as the singular values of trained weights often do).
    """
    batch, size = start.shape
    basis = start.new_zeros(batch, steps, size)
    alpha, beta = start.new_zeros(batch, steps), start.new_zeros(batch, steps)
    q = start / torch.linalg.vector_norm(start, dim=1, keepdim=True).clamp_min(1e-30)
    scale = None
    for j in range(steps):
        basis[:, j] = q
        w = apply(q)
        if scale is None:
            scale = torch.linalg.vector_norm(w, dim=1)
        alpha[:, j] = (q * w).sum(dim=1)
        earlier = basis[:, : j + 1]
        for _ in range(2):  # against every earlier vector, twice
            w = w - torch.bmm(torch.bmm(w[:, None], earlier.transpose(1, 2)), earlier)[:, 0]
        norm = torch.linalg.vector_norm(w, dim=1)
        # a breakdown (the space found is invariant: a Gram matrix of lower rank than its size)
        # ends that operator's iteration, without a host sync: rounding noise scaled up to a
        # unit vector would break the tridiagonal form and overestimate the top eigenvalue
        alive = norm > BREAKDOWN * scale
        beta[:, j] = torch.where(alive, norm, 0.0)
        q = torch.where(alive[:, None], w / norm[:, None].clamp_min(1e-30), 0.0)
    off = beta[:, :-1]
    tridiagonal = torch.diag_embed(alpha) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    return basis, tridiagonal


def top_eigenpairs(matrices: torch.Tensor, squarings: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest eigenvalue and a unit eigenvector of each of a batch (b, k, k) of small
    symmetric positive semi-definite matrices, on their device in float64 without a host sync
    (torch's eigh checks its solver's result on the host: on CUDA a wait per weight).

    Squared ``squarings`` times and normalised each time, a matrix tends to a multiple of the
    projector on its top eigenvector (its eigenvalues' ratios raised to the 2**squarings-th
    power); the projector's largest column points along that vector, and the Rayleigh quotient
    of it is the eigenvalue, accurate to float64 rounding of the matrix's norm. Eigenvalues that
    tie make a projector on their space, any vector of which has the same quotient."""
    wide = matrices.to(torch.float64)
    power = wide
    for _ in range(squarings):
        power = power / torch.linalg.matrix_norm(power, keepdim=True).clamp_min(1e-300)
        power = power @ power
    largest = torch.linalg.vector_norm(power, dim=1).argmax(dim=1)  # (b,) the largest column
    vectors = torch.gather(power, 2, largest[:, None, None].expand(-1, power.shape[1], 1))[..., 0]
    vectors = vectors / torch.linalg.vector_norm(vectors, dim=1, keepdim=True).clamp_min(1e-300)
    values = torch.einsum("bi,bij,bj->b", vectors, wide, vectors)
    return values.to(matrices.dtype), vectors.to(matrices.dtype)


class GramBatch:
    """The Gram operators of whole weights whose smaller side has one length, each over its
    Frobenius norm, applied together: each weight is read twice per product, as it would be
    alone, while the Lanczos recurrence around the products runs once for the batch."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.copied = 0
        self._tall: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._inverse: torch.Tensor | None = None

    def add(self, index: int, weight: torch.Tensor, scale: torch.Tensor, copied: bool) -> None:
        """Weight ``index`` (float32) over ``scale``; ``copied``: a float32 copy made for it,
        whose bytes count against COPY_BYTES while the batch is open."""
        self.indices.append(index)
        self._tall.append(weight if weight.shape[0] >= weight.shape[1] else weight.T)
        self._scales.append(scale)
        self.copied += weight.numel() * weight.element_size() if copied else 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        """(W / s)^T (W / s) v for each weight's row of ``v``; the vector is scaled before each
        product, so no intermediate exceeds the weight's own size."""
        if self._inverse is None:
            self._inverse = 1.0 / torch.stack(self._scales)[:, None]
        rows = (v * self._inverse).unbind(0)
        products = [torch.mv(tall.T, torch.mv(tall, row)) for tall, row in zip(self._tall, rows)]
        return torch.stack(products) * self._inverse


class GramBatches:
    """The open batches of one step's whole weights, by key (device, Gram size, warm start or
    not). A batch is handed back to be run when it holds BATCH_WEIGHTS weights, and the largest
    when the copies of all open batches pass COPY_BYTES, so that a large model's float32 copies
    of bf16 weights never all live at once."""

    def __init__(self) -> None:
        self._open: dict[Hashable, GramBatch] = {}

    def add(
        self, key: Hashable, index: int, weight: torch.Tensor, scale: torch.Tensor, copied: bool
    ) -> list[tuple[Hashable, GramBatch]]:
        """Add a weight; returns the batches to run now (closed here)."""
        batch = self._open.setdefault(key, GramBatch())
        batch.add(index, weight, scale, copied)
        ready = [key] if len(batch.indices) >= BATCH_WEIGHTS else []
        if sum(b.copied for b in self._open.values()) >= COPY_BYTES and not ready:
            ready = [max(self._open, key=lambda k: self._open[k].copied)]
        return [(k, self._open.pop(k)) for k in ready]

    def close(self) -> list[tuple[Hashable, GramBatch]]:
        """Every batch still open (closed here)."""
        ready, self._open = list(self._open.items()), {}
        return ready


def alone(gram: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor) -> torch.Tensor:
    """A one-weight Gram operator applied to a batch of one (``lanczos``'s shape)."""
    return gram(v[0])[None]


def padded(tridiagonals: torch.Tensor, width: int) -> torch.Tensor:
    """A batch of (k, k) matrices padded with zeros to (width, width)."""
    extra = width - tridiagonals.shape[1]
    return torch.nn.functional.pad(tridiagonals, (0, extra, 0, extra)) if extra else tridiagonals
