"""MethodWrap: hooks around one method of one object, removed exactly, the class never touched."""

from __future__ import annotations

import pytest

from adapters.torch.method_wrap import MethodWrap


class Bucket:
    def __init__(self) -> None:
        self.calls: list = []

    def sync(self, value: int = 0, *, force: bool = False) -> int:
        self.calls.append(("sync", value, force))
        if value < 0:
            raise ValueError("negative")
        return value + 1


def _hooks(log: list, name: str):
    return (
        lambda obj, args, kwargs: log.append((name, "before", args, kwargs)),
        lambda obj, args, kwargs: log.append((name, "after", args, kwargs)),
    )


def test_hooks_run_around_the_call_and_the_result_is_unchanged():
    bucket, log = Bucket(), []
    MethodWrap(bucket, "sync", *_hooks(log, "a"))
    assert bucket.sync(2, force=True) == 3
    assert log == [("a", "before", (2,), {"force": True}), ("a", "after", (2,), {"force": True})]
    assert bucket.calls == [("sync", 2, True)]


def test_only_this_instance_is_wrapped_and_removal_restores_the_class_method():
    bucket, other, log = Bucket(), Bucket(), []
    handle = MethodWrap(bucket, "sync", *_hooks(log, "a"))
    other.sync(1)
    assert log == []
    handle.remove()
    handle.remove()
    assert "sync" not in vars(bucket)
    assert Bucket.sync.__qualname__ == "Bucket.sync"
    bucket.sync(1)
    assert log == []


def test_an_exception_of_the_original_propagates_and_skips_after():
    bucket, log = Bucket(), []
    MethodWrap(bucket, "sync", *_hooks(log, "a"))
    with pytest.raises(ValueError, match="negative"):
        bucket.sync(-1)
    assert [entry[:2] for entry in log] == [("a", "before")]


def test_before_only():
    bucket, log = Bucket(), []
    MethodWrap(bucket, "sync", _hooks(log, "a")[0])
    bucket.sync(0)
    assert [entry[:2] for entry in log] == [("a", "before")]


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_two_wrappers_removed_in_any_order_leave_the_instance_as_it_was(order):
    bucket, log = Bucket(), []
    handles = {name: MethodWrap(bucket, "sync", *_hooks(log, name)) for name in ("a", "b")}
    bucket.sync(1)
    assert [entry[:2] for entry in log] == [("b", "before"), ("a", "before"), ("a", "after"), ("b", "after")]
    handles[order[0]].remove()
    log.clear()
    bucket.sync(1)
    assert {entry[0] for entry in log} == {order[1]}
    handles[order[1]].remove()
    assert "sync" not in vars(bucket)


def test_an_attribute_the_instance_had_is_put_back():
    bucket = Bucket()
    own = bucket.sync  # an instance attribute set by someone else before us
    bucket.sync = own
    handle = MethodWrap(bucket, "sync", lambda *a: None)
    handle.remove()
    assert vars(bucket)["sync"] is own
