"""The process-wide, reference-counted owner of an adapter's collective wrappers (framework-free).

Both adapters share collective wrappers between monitors the same way: the first subscriber
wraps, the last one to leave restores the originals; monitors in between only subscribe, so two
monitors never wrap each other's wrappers. A wrapper tells the listening subscribers before and
after the original runs, always calls the original with the caller's arguments and returns its
result unchanged. A call made while another wrapped call runs on the same thread goes straight
to the original, so each user call is seen once. What is wrapped, and how it is put back, is
the adapter's part (``_wrap`` and ``_restore``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Subscriber(Protocol):
    """What a monitor offers the wrappers (see the adapters' CollectiveMonitor)."""

    listening: bool

    def before(self, call: Any) -> Any: ...

    def after(self, token: Any, result: Any) -> None: ...


class _Nesting(threading.local):
    depth = 0


class WrapperRegistry:
    """Subscribe wraps, the last unsubscribe restores; ``observed`` makes one wrapper."""

    def __init__(self) -> None:
        self.subscribers: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()
        self._nesting = _Nesting()

    @property
    def wrapped(self) -> list[str]:
        """Names of what is wrapped now (empty when nothing is)."""
        raise NotImplementedError

    def subscribe(self, monitor: Subscriber) -> list[str]:
        """Add a monitor; the first one wraps. Returns the wrapped names."""
        with self._lock:
            if monitor not in self.subscribers:
                self.subscribers = (*self.subscribers, monitor)
                if len(self.subscribers) == 1:
                    self._wrap()
            return self.wrapped

    def unsubscribe(self, monitor: Subscriber) -> None:
        """Remove a monitor; the last one restores the originals."""
        with self._lock:
            if monitor not in self.subscribers:
                return
            self.subscribers = tuple(m for m in self.subscribers if m is not monitor)
            if not self.subscribers:
                self._restore()

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """Collectives called inside go straight to the originals, unseen (the monitor's own calls)."""
        self._nesting.depth += 1
        try:
            yield
        finally:
            self._nesting.depth -= 1

    def observed(self, original: Callable, make_call: Callable[[tuple, dict], Any]) -> Callable:
        """A wrapper of ``original`` that shows each call, as ``make_call(args, kwargs)``, to the subscribers.

        Args:
            original: the function to call through to.
            make_call: builds what ``Subscriber.before`` receives; called only when some
                subscriber may listen.
        """
        nesting = self._nesting

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            subscribers = self.subscribers
            if nesting.depth or not subscribers:
                return original(*args, **kwargs)
            call = make_call(args, kwargs)
            tokens = [(m, m.before(call)) for m in subscribers if m.listening]
            nesting.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                nesting.depth -= 1
            for monitor, token in tokens:
                if token is not None:
                    monitor.after(token, result)
            return result

        return wrapper

    def _wrap(self) -> None:
        """Wrap the framework's collectives (called under the lock, by the first subscriber)."""
        raise NotImplementedError

    def _restore(self) -> None:
        """Put back every original (called under the lock, when the last subscriber leaves)."""
        raise NotImplementedError
