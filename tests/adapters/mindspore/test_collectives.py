"""The per-instance wrapping of collective primitives in one process: found, shared, given back.

Calling a collective needs a communication group (see test_distributed.py for real calls);
creating the primitives does not, which is all the wrapping needs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

from mindspore import ops

from adapters.mindspore.cc_wrap import WrapRegistry


class _Subscriber:
    listening = False

    def before(self, call):
        raise AssertionError("no collective is called here")

    def after(self, token, result):
        raise AssertionError("no collective is called here")


def test_instances_are_wrapped_once_shared_and_given_their_class_back():
    registry = WrapRegistry()
    all_reduce, all_gather, broadcast, add = ops.AllReduce(), ops.AllGather(), ops.Broadcast(0), ops.Add()
    first, second = _Subscriber(), _Subscriber()
    registry.subscribe(first)
    wrapped = type(all_reduce)
    assert wrapped is not ops.AllReduce and issubclass(wrapped, ops.AllReduce)
    assert isinstance(all_reduce, ops.AllReduce) and wrapped.__name__ == "AllReduce"
    assert type(all_gather).__bases__ == (ops.AllGather,) and type(broadcast).__bases__ == (ops.Broadcast,)
    assert type(add) is ops.Add  # other primitives are left alone
    registry.subscribe(second)  # a second monitor subscribes: nothing is wrapped twice
    assert type(all_reduce) is wrapped and type(all_reduce).__bases__ == (ops.AllReduce,)
    late = ops.AllReduce()
    assert type(late) is ops.AllReduce
    registry.rescan()
    assert type(late) is wrapped
    registry.unsubscribe(first)
    assert type(all_reduce) is wrapped  # still in use by the second monitor
    registry.unsubscribe(second)
    assert type(all_reduce) is ops.AllReduce and type(late) is ops.AllReduce
    assert type(all_gather) is ops.AllGather and type(broadcast) is ops.Broadcast
    registry.rescan()  # nobody subscribes: nothing is wrapped
    assert type(all_reduce) is ops.AllReduce
