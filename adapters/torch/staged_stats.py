"""Statistics of accelerator tensors measured one at a time (a hook per module or parameter) in a
few launches for many tensors.

A hook cannot wait for its peers, and the tensor it sees may change once it returns (a gradient
accumulated in place, an activation modified by the next layer). So each tensor is copied, at
the hook, into the open staging buffer of its device (one launch, widening half types to float32
exactly), and the buffer's tensors are measured together (``device_stats.device_block``: a few
launches for all of them) when it is full or when a row is read. A hook gets a ``StagedRow``
back; ``stack_rows`` in adapters.torch.stats reads them (``stacked_rows``: one gather for all).
Buffers hold at most PACK_ELEMENTS elements (64 MB of float32) and exist only while open; a
larger tensor is measured at once.

Hooks run on the training thread (forward) and on autograd's device threads (backward): a lock
per stager keeps the buffer consistent. Copies made on one CUDA stream and measured from another
are ordered by making the measuring stream wait for the copying ones, and a reader on a third
waits for the measuring one; the buffer is recorded on every stream that used it. (Side streams
are not covered by a test: the machines that run the tests have no GPU.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from adapters.torch import device_stats
from adapters.torch.device_stats import accumulate_dtype, device_block, on_device


class StagedRow:
    """The statistics row of a tensor copied into a staging buffer: ``value()`` is the float64
    vector (len(ops),) on the device, measured with the rest of its buffer when first asked for."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self._batch, self._index = batch, index

    def value(self) -> torch.Tensor:
        return self._batch.rows()[self._index]


class _Batch:
    """One staging buffer and the tensors copied into it; its rows once measured."""

    def __init__(self, stager: Stager, buffer: torch.Tensor) -> None:
        self.stager = stager
        self.buffer: torch.Tensor | None = buffer
        self.views: list[torch.Tensor] = []
        self.filled = 0
        self.streams: set = set()
        self.matrix: torch.Tensor | None = None
        #: the CUDA stream the rows were measured on (None elsewhere)
        self.sealed_on: Any = None

    def rows(self) -> torch.Tensor:
        if self.matrix is None:
            with self.stager.lock:
                if self.matrix is None:
                    self.stager.seal(self)
        if self.sealed_on is not None and torch.cuda.current_stream(self.stager.device) != self.sealed_on:
            torch.cuda.current_stream(self.stager.device).wait_stream(self.sealed_on)  # measured there
        return self.matrix


class Stager:
    """The open staging buffer of one device and accumulation type, for one set of ops and eps."""

    def __init__(self, device: torch.device, dtype: torch.dtype, ops: tuple[str, ...], eps: float) -> None:
        self.device, self.dtype, self.ops, self.eps = device, dtype, ops, eps
        self.lock = threading.Lock()
        self._open = _no_batch  # weakly: a batch whose rows were all dropped goes with its buffer

    def stage(self, t: torch.Tensor) -> StagedRow | None:
        """Copy ``t`` into the open buffer; None where it is larger than a buffer."""
        size = t.numel()
        capacity = device_stats.PACK_ELEMENTS
        if size > capacity:
            return None
        with self.lock:
            batch = self._open()
            if batch is None or batch.filled + size > capacity:
                if batch is not None:
                    self.seal(batch)
                with torch.inference_mode(False):  # copied into from inference mode too
                    buffer = torch.empty(capacity, dtype=self.dtype, device=self.device)
                batch = _Batch(self, buffer)
                self._open = weakref.ref(batch)
            view = batch.buffer[batch.filled : batch.filled + size]
            with torch.no_grad():
                view.copy_(t.reshape(-1))
            if self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                if stream not in batch.streams:  # the buffer, even dropped unsealed, outlives the copy
                    batch.streams.add(stream)
                    batch.buffer.record_stream(stream)
            batch.views.append(view)
            batch.filled += size
            return StagedRow(batch, len(batch.views) - 1)

    def seal(self, batch: _Batch) -> None:
        """Measure a batch's tensors (the lock held) and let its buffer go."""
        if self._open() is batch:
            self._open = _no_batch
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for stream in batch.streams - {current}:
                current.wait_stream(stream)
            batch.buffer.record_stream(current)  # not reused before the measuring stream read it
            batch.sealed_on = current
        with torch.no_grad():
            batch.matrix = device_block(batch.views, self.ops, self.eps, laid_out=batch.buffer)
        batch.buffer, batch.views = None, []


def stacked_rows(rows: Sequence[StagedRow]) -> torch.Tensor:
    """Staged rows as one float64 (len(rows), len(ops)) matrix on their device: each batch read
    once and the rows picked from the batches' matrices with one gather, not a view per row."""
    offsets: dict[int, int] = {}
    matrices, index, total = [], [], 0
    for row in rows:
        batch = row._batch
        at = offsets.get(id(batch))
        if at is None:
            at = offsets[id(batch)] = total
            matrices.append(batch.rows())
            total += len(matrices[-1])
        index.append(at + row._index)
    whole = matrices[0] if len(matrices) == 1 else torch.cat(matrices)
    if index == list(range(total)):
        return whole
    return whole.index_select(0, on_device(index, torch.long, whole.device))


def _no_batch() -> None:
    """What a stager's open batch is when none is open."""
    return None


_STAGERS: dict[tuple, Stager] = {}
_STAGERS_LOCK = threading.Lock()


def staged_row(t: torch.Tensor, ops: tuple[str, ...], eps: float) -> StagedRow | None:
    """``t``'s row, staged with the other tensors of its device measured one at a time; None
    where staging does not apply (integer tensors, the ``id`` op, a tensor larger than a buffer)."""
    if not t.is_floating_point() or "id" in ops:
        return None
    key = (t.device, accumulate_dtype(t.dtype), ops, eps)
    stager = _STAGERS.get(key)
    if stager is None:
        with _STAGERS_LOCK:
            stager = _STAGERS.setdefault(key, Stager(*key))
    return stager.stage(t)
