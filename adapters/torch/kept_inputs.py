"""The module inputs a step keeps for its evidence bundles: references, never copies, within a
byte budget the session sets at each step's end."""

from __future__ import annotations

import torch

from adapters.torch.dist import local_tensor


class KeptInputs:
    """Per module call, its inputs and their versions (an input written in place after the call
    is not what the module saw); the budget counts each storage once."""

    def __init__(self, dtensor: type | tuple) -> None:
        self._dtensor = dtensor
        #: the bytes of module inputs the step may still hold on to (0: keep none)
        self.left = 0
        #: this step's kept inputs: (vpp_stage, module call, micro-step) -> [(tensor, version)]
        self.inputs: dict[tuple[int, str, int], list[tuple[torch.Tensor, int]]] = {}
        self._storages: set[int] = set()

    def start(self, budget: int) -> None:
        """Drop the inputs kept so far and keep those of the coming steps' module calls, while
        their storages total at most ``budget`` bytes. The session calls this at every step end,
        once the step's evidence bundles are written."""
        self.left = budget
        self.inputs = {}
        self._storages = set()

    def keep(self, vpp: int, name: str, micro: int, tensors: list[torch.Tensor]) -> None:
        """Hold on to a call's inputs, all of them or none, within the budget; a storage shared by
        several inputs (views, one module's output feeding the next) is counted once."""
        local = [local_tensor(t) if isinstance(t, self._dtensor) else t for t in tensors]
        storages = {
            storage.data_ptr(): storage.nbytes()
            for storage in (t.untyped_storage() for t in local)
            if storage.data_ptr() not in self._storages
        }
        needed = sum(storages.values())
        if not local or needed > self.left:
            return
        self.left -= needed
        self._storages.update(storages)
        self.inputs[(vpp, name, micro)] = [(t.detach(), t._version) for t in local]
