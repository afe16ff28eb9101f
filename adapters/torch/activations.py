"""Module activations: statistics of inputs/outputs (``actv``) and their gradients (``actv_grad``).

Forward: a forward pre-hook measures the inputs before the module runs (so a module that works
in place is measured on what it received) and a forward hook measures the outputs. Backward:
tensor hooks registered on those same tensors receive dL/d(output) and dL/d(input). Tensor hooks
wrap nothing, so, unlike full backward hooks (which torch implements by routing tensors through
an identity Function), an in-place op after the module or a view returned by it keeps working,
and nothing global is patched (msprobe registers global hooks). ``input_grad`` is therefore the
gradient of the loss with respect to the tensor the module received; when that tensor also
feeds other modules it includes their contributions. Under tensor parallelism, where the module
receives a DTensor made from its caller's replicated tensor, the caller's tensor is the one
watched (sharded.tp_activations.as_passed), so that those contributions are in it too.

Micro-steps are counted by a pre-hook on each model chunk's root (one call per micro-batch); a
forward inside a backward pass (activation-checkpoint recompute) is recognised as
torch.utils.checkpoint does, by ``torch._C._current_graph_task_id() != -1``, not from the Python
stack: it is not measured again, only given the gradient hooks that reentrant checkpointing needs.

Under torch.compile the hooks leave nothing in compiled code, and the steps they measure run
it eagerly (adapters.torch.compiled). With ``shard_reduce``,
tensor-parallel modules' tensors merge into whole ones (sharded.tp_activations).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from adapters.torch.dist import dtensor_type, local_tensor
from adapters.torch.hooked_modules import HookedModule, direction_tensors_of, mask_arguments
from adapters.torch.kept_inputs import KeptInputs
from adapters.torch.micro_steps import MicroSteps
from adapters.torch.sharded.tp_activations import Piece, TensorParallelMerge, as_passed, passed_pieces
from adapters.torch.stats import stack_rows, tensor_stats
from monitor.datatypes.leaf_grads import LeafGradients
from monitor.datatypes.modules import call_name, row_names
from monitor.record import RowSet, SameRows
from monitor.session.collection import UnendedStep

logger = logging.getLogger("trainmon")


def _same_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether a view covers its base whole, element for element."""
    layout = (view.dtype, view.shape, view.stride(), view.storage_offset())
    return layout == (base.dtype, base.shape, base.stride(), base.storage_offset())


def _row_set(rows: list[tuple[int, str, int]], rank: int, task: str, unjudged: list[bool]) -> RowSet:
    """The RowSet of a step's ``(vpp_stage, name, micro_step)`` rows; ``unjudged``: which are data."""
    vpp, names, micro = zip(*rows)
    return RowSet.build(vpp, names, rank, task, micro, unjudged)


class Activations:
    """Hooks on selected modules; statistics kept as small vectors until the step is written."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        modules: list[HookedModule],
        ops: tuple[str, ...],
        eps: float,
        forward: bool,
        backward: bool,
        on_error: Callable[[str, BaseException], None],
        merge: TensorParallelMerge | None = None,
        unended: UnendedStep | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.modules = modules
        self.ops = ops
        self.eps = eps
        self.forward = forward
        self.backward = backward
        self.on_error = on_error
        #: set by the session before each step's forward: the hooks do nothing when False.
        self.collect = False
        self.micro = MicroSteps(self.chunks, lambda: self.collect, unended, self._forget_rows)
        #: calls per (module, micro-step) so far, in the forward and in checkpoint recomputes.
        self._calls: dict[tuple[int, int], int] = {}
        self._recomputed: dict[tuple[int, int], int] = {}
        self._rows: dict[str, list[tuple[int, str, int]]] = {"actv": [], "actv_grad": []}
        self._stats: dict[str, list[list[float] | torch.Tensor]] = {"actv": [], "actv_grad": []}
        #: per row, whether its tensor holds integers or booleans (data the rules leave alone)
        self._unjudged: dict[str, list[bool]] = {"actv": [], "actv_grad": []}
        #: with ``merge``: each row's mesh tag (None: left per rank), and the spread of the raw
        #: outputs of each module's last call, seen before tensor parallelism makes them local
        self.merge = merge
        self._failure_said = False
        self._tags: dict[str, list[Piece | None]] = {"actv": [], "actv_grad": []}
        self._spreads: dict[int, list] = {}
        #: the last step's RowSet per prefix, handed out again while the rows stay the same
        self._same_rows = {"actv": SameRows(), "actv_grad": SameRows()}
        #: this step's measured tensors: id -> (weak reference, version, statistics row, mesh
        #: tag, the positions of the rows naming it). A tensor that is one module's output and the
        #: next one's input (or its gradient, seen by both modules' hooks) is measured once.
        self._seen: dict[
            int, tuple[weakref.ref, int, list[float] | torch.Tensor, Piece | None, list[int]]
        ] = {}
        self._dtensor = dtensor_type()
        #: the inputs the caller passed to a tensor-parallel module, before it made DTensors of them
        self._passed: dict[int, tuple] = {}
        #: this step's tensors with a gradient hook: id -> (weak reference, version, the rows it
        #: names, [its mesh tag], which a later module may set)
        self._watched: dict[int, tuple[weakref.ref, int, list[tuple[int, str, int]], list]] = {}
        #: the rows some tensor's hook names this step: a checkpoint's recompute watches only those
        #: its forward could not (run without gradients, as the reentrant checkpoint runs it); a
        #: recomputed input is a detached copy whose gradient is only the checkpointed part's share
        self._watched_rows: set[tuple[int, str, int]] = set()
        self._leaves = LeafGradients(self._measure_grad)
        #: while evidence bundles are wanted, the module inputs the step holds on to for them
        self.kept = KeptInputs(self._dtensor)

    def register(self) -> list:
        """Register the hooks; returns removable handles."""
        handles = [*self.micro.register(), self._leaves]
        for index, entry in enumerate(self.modules):
            tensor_parallel = any(isinstance(p, self._dtensor) for p in entry.module.parameters(False))
            if tensor_parallel and (self.backward or self.merge is not None):
                passed = self._passed_hook(index)  # before tensor parallelism's own input hook
                handles.append(entry.module.register_forward_pre_hook(passed, prepend=True, with_kwargs=True))
            handles.append(entry.module.register_forward_pre_hook(self._before(index), with_kwargs=True))
            handles.append(entry.module.register_forward_hook(self._after(index), with_kwargs=True))
            if self.merge is not None:
                handles.append(entry.module.register_forward_hook(self._raw_output(index), prepend=True))
        return handles + self.micro.register_ends()

    def _raw_output(self, index: int) -> Callable:
        """A hook run before the module's other forward hooks: how its outputs are spread over a
        mesh while they are still DTensors (tensor parallelism's hook then makes them local)."""

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self.micro.records(module, self.modules[index].vpp_stage, args):
                self._spread(index, output)

        return hook

    def _spread(self, index: int, output: Any) -> None:
        try:
            tensors = direction_tensors_of(self.modules[index], "output", output)
            self._spreads[index] = [self.merge.spread(t) for t in tensors]
        except Exception as exc:
            self.failed("actv", exc)

    def _call_name(self, index: int, micro: int, recompute: bool) -> str:
        """Module name, with ``[k]`` for the k-th extra call within one micro-step.

        A recompute replays the forward's calls in order, so it counts its own calls.
        """
        call = (self._recomputed if recompute else self._calls).get((index, micro), 0)
        return call_name(self.modules[index].name, call)

    def _passed_hook(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.micro.records(module, self.modules[index].vpp_stage, args, kwargs):
                self._passed[index] = (*args, *kwargs.values()) if kwargs else args

        return hook

    def _before(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.micro.records(module, self.modules[index].vpp_stage, args, kwargs):
                self._inputs(index, args, kwargs)

        return hook

    def _inputs(self, index: int, args: tuple, kwargs: dict) -> None:
        try:
            entry = self.modules[index]
            micro = self.micro.of(entry.vpp_stage)
            recompute = torch._C._current_graph_task_id() != -1
            tensors = direction_tensors_of(entry, "input", (*args, *kwargs.values()) if kwargs else args)
            name = self._call_name(index, micro, recompute)
            tags = self._known_tags(tensors) if self.merge is not None else None
            if self.forward and not recompute:
                masks = mask_arguments(entry, args, kwargs)
                self._measure("actv", entry.vpp_stage, f"{name}.input", micro, tensors, tags, masks)
            passed = self._passed.pop(index, None)
            given = None if passed is None else direction_tensors_of(entry, "input", passed)
            if given is not None and self.merge is not None and not recompute:
                for piece, tag in passed_pieces(tensors, given, self._dtensor, self.merge):
                    self._retag(piece, tag)
            if self.backward:
                watched, watched_tags = tensors, tags
                if given is not None:
                    watched, watched_tags = as_passed(tensors, tags, given, self._dtensor, self.merge)
                self._watch(entry.vpp_stage, f"{name}.input_grad", micro, watched, watched_tags)
            if self.kept.left and not recompute:
                self.kept.keep(entry.vpp_stage, name, micro, tensors)
        except Exception as exc:
            self.failed("actv", exc)

    def _retag(self, piece: torch.Tensor, tag: Piece) -> None:
        """A plain tensor recorded this step (or the base it is a whole view of) turns out to be
        a piece of a tensor spread over a mesh: its rows and its gradient's take the tag."""
        for t in (
            (piece, piece._base) if piece._base is not None and _same_view(piece, piece._base) else (piece,)
        ):
            hit = self._seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[3] is None:
                self._seen[id(t)] = (*hit[:3], tag, hit[4])
                for position in hit[4]:
                    self._tags["actv"][position] = tag
            watched = self._watched.get(id(t))
            if watched is not None and watched[0]() is t and watched[3][0] is None:
                watched[3][0] = tag

    def _after(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.micro.records(module, self.modules[index].vpp_stage, args, kwargs):
                self._outputs(index, output)

        return hook

    def _outputs(self, index: int, output: Any) -> None:
        try:
            entry = self.modules[index]
            micro = self.micro.of(entry.vpp_stage)
            recompute = torch._C._current_graph_task_id() != -1
            tensors = direction_tensors_of(entry, "output", output)
            name = self._call_name(index, micro, recompute)
            tags = self._output_tags(index, tensors) if self.merge is not None else None
            if self.forward and not recompute:
                self._measure("actv", entry.vpp_stage, f"{name}.output", micro, tensors, tags)
            if self.backward:
                self._watch(entry.vpp_stage, f"{name}.output_grad", micro, tensors, tags)
            calls = self._recomputed if recompute else self._calls
            calls[(index, micro)] = calls.get((index, micro), 0) + 1
        except Exception as exc:
            self.failed("actv", exc)

    def _known_tags(self, tensors: list[torch.Tensor]) -> list[Piece | None]:
        """Mesh tags of plain tensors measured earlier this step, or of whole views of them (None
        for the others): FSDP2's pre-forward hands a module views of its inputs (an autograd
        function returning them), and the block's input lost the tag of the tensor it is."""
        tags = []
        for t in tensors:
            known = t if t._base is None or not _same_view(t, t._base) else t._base
            hit = self._seen.get(id(known))
            tags.append(
                hit[3] if hit is not None and hit[0]() is known and hit[1] == known._version else None
            )
        return tags

    def _output_tags(self, index: int, tensors: list[torch.Tensor]) -> list[Piece | None]:
        """Mesh tags of a call's plain outputs, from how the raw outputs were spread."""
        spreads = self._spreads.pop(index, None)
        if spreads is None or len(spreads) != len(tensors):
            return self._known_tags(tensors)
        dtensor = self._dtensor  # a DTensor output is tagged by itself when measured
        return [None if isinstance(t, dtensor) else self.merge.piece(t, s) for t, s in zip(tensors, spreads)]

    def _measure(
        self,
        prefix: str,
        vpp: int,
        name: str,
        micro: int,
        tensors: list[torch.Tensor],
        tags: list[Piece | None] | None = None,
        masks: AbstractSet[int] = frozenset(),
    ) -> None:
        if not tensors:
            return
        # a DTensor's piece first, for every tensor: its partial sums are collectives that the
        # mesh mates take too, whatever measuring does after
        resolved = [self._piece(t, tags[k] if tags is not None else None) for k, t in enumerate(tensors)]
        seen = self._seen
        rows, row_tags = [], []
        for position, (t, tag) in enumerate(resolved, len(self._stats[prefix])):
            hit = seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                rows.append(hit[2])
                row_tags.append(hit[3] if tag is None else tag)
                hit[4].append(position)
            else:
                row = tensor_stats(t, self.ops, self.eps)
                positions = [position]
                seen[id(t)] = (weakref.ref(t), t._version, row, tag, positions)
                base = t._base
                if tag is not None and base is not None and _same_view(t, base):
                    known = seen.get(id(base))  # an entry of a tensor freed since may hold its id
                    if known is None or known[0]() is not base:  # the same values, rows
                        seen[id(base)] = (weakref.ref(base), base._version, row, tag, positions)
                rows.append(row)
                row_tags.append(tag)
        self._rows[prefix].extend((vpp, n, micro) for n in row_names(name, len(tensors)))
        self._stats[prefix].extend(rows)
        self._unjudged[prefix].extend(  # integers, booleans and masks (-inf by design) are data
            not (t.is_floating_point() or t.is_complex()) or id(given) in masks
            for (t, _), given in zip(resolved, tensors)
        )
        if self.merge is not None:
            self._tags[prefix].extend(row_tags)

    def _piece(self, t: torch.Tensor, tag: Piece | None) -> tuple[torch.Tensor, Piece | None]:
        """A tensor as measured: a DTensor's local piece, partial sums done (tagged to merge)."""
        if not isinstance(t, self._dtensor):
            return t, tag
        return self.merge.local(t) if self.merge is not None else (local_tensor(t), tag)

    def failed(self, prefix: str, exc: BaseException) -> None:
        """Switched off, as any failure is; with tensor-parallel merges on (their hooks take partial
        sums with the mesh mates, who would wait) said once, the failing calls without rows."""
        if self.merge is None:
            self.collect = False
            self.on_error(prefix, exc)
        elif not self._failure_said:
            self._failure_said = True
            told = "stays on (the tensor-parallel mesh mates take collectives with its hooks)"
            logger.error("trainmon: %s failed (%r) and %s", prefix, exc, told, exc_info=exc)

    def _watch(
        self, vpp: int, name: str, micro: int, tensors: list[torch.Tensor], tags: list[Piece | None] | None
    ) -> None:
        """Have the gradients of the tensors that take part in autograd measured: one hook per
        tensor, which names every row watching it (a module's output is usually the next one's
        input: half the hooks, whose registration is most of a watch's cost). A tensor changed
        in place since gets a hook of its own: its gradient is that of the new version. A
        gradient is spread over a mesh as its tensor is (``tags``)."""
        watched = self._watched
        for position, (tensor, row) in enumerate(zip(tensors, row_names(name, len(tensors)))):
            if not tensor.requires_grad or (vpp, row, micro) in self._watched_rows:
                continue  # a checkpoint's recompute sees again what the forward watched
            tag = tags[position] if tags is not None else None
            if tensor.is_leaf:  # a Parameter returned or received: its hook outlives the pass
                if torch.is_grad_enabled():  # else no backward pass follows this forward
                    self._watched_rows.add((vpp, row, micro))
                    self._leaves.watch(tensor, (vpp, row, micro), [tag])
                continue
            self._watched_rows.add((vpp, row, micro))
            hit = watched.get(id(tensor))
            if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
                hit[2].append((vpp, row, micro))
                if hit[3][0] is None:
                    hit[3][0] = tag
                continue
            rows, tagged = [(vpp, row, micro)], [tag]
            watched[id(tensor)] = (weakref.ref(tensor), tensor._version, rows, tagged)
            tensor.register_hook(functools.partial(self._measure_grad, rows, tagged))

    def _measure_grad(self, rows: list[tuple[int, str, int]], tagged: list, grad: torch.Tensor) -> None:
        """A watched tensor's gradient hook: the gradient fills each row naming it, with the
        tensor's mesh tag (``tagged[0]``, set by the time the backward runs)."""
        if not self.collect:
            return
        try:
            for vpp, name, micro in rows:  # the gradient is measured once (``_seen``)
                self._measure("actv_grad", vpp, name, micro, [grad], tagged)
        except Exception as exc:
            self.failed("actv_grad", exc)

    def micro_batches(self) -> int:
        """Micro-batches the step's forwards counted so far."""
        return self.micro.counted()

    def take(self, rank: int) -> list[tuple[str, RowSet, torch.Tensor]]:
        """This step's records: ``(prefix, rows, statistics)`` for actv and actv_grad; resets."""
        try:
            matrices = {prefix: stack_rows(self._stats[prefix], len(self.ops)) for prefix in self._rows}
        except Exception:
            self.merge is None or self.merge.merge([], self.ops)  # the mesh mates wait for its header
            raise
        if self.merge is not None:  # every rank, rows or not: its mesh mates wait for its header
            self.merge.merge(
                [
                    ([f"{v}:{n}:{m}" for v, n, m in self._rows[prefix]], matrices[prefix], self._tags[prefix])
                    for prefix in self._rows
                ],
                self.ops,
            )
        out = []
        for prefix, task in (("actv", "actv"), ("actv_grad", "actv_grad")):
            rows, unjudged = self._rows[prefix], self._unjudged[prefix]
            if rows:
                build = functools.partial(_row_set, rows, rank, task, unjudged)
                row_set = self._same_rows[prefix].get((rows, unjudged), build)
                out.append((prefix, row_set, matrices[prefix]))
        self.reset()
        return out

    def reset(self) -> None:
        """Forget the step (a module that does not run in a step has no row for it)."""
        self.micro.reset()
        self._spreads.clear()
        self._forget_rows()

    def _forget_rows(self) -> None:
        """Drop the rows held so far (and what names them) for the micro-steps to come."""
        self._calls.clear()
        self._recomputed.clear()
        self._passed.clear()
        self._seen.clear()
        self._watched.clear()
        self._watched_rows.clear()
        self._leaves.remove()
        for prefix in self._rows:
            self._rows[prefix] = []
            self._stats[prefix] = []
            self._unjudged[prefix] = []
            self._tags[prefix] = []
