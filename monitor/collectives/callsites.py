"""Call stacks of collective calls: msprobe's stack string, cheaply, and cc_codeline matching.

Framework-free; each adapter says which frames are left out (trainmon's own and its framework's
internals). A frame renders as ``"{path}[{line}]   {function}"`` and frames are
joined with ``";"``, innermost first, as msprobe joins them, so cc_codeline patterns written for the
reference (``train.py\\[23\\]``) work unchanged.

The walk uses ``sys._getframe`` and code objects only (no source lines are read); the rendering
of a frame is cached per (code object, line) and the decision per whole stack, so a call from a
known place costs one walk and a few dictionary look-ups.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from types import CodeType

#: cached stacks before the caches are cleared (a bound, not a tuning knob).
MAX_CACHED = 4096

Frame = tuple[CodeType, int]


class CallSites:
    """Renders call stacks and decides, per stack, whether a call is kept and from where.

    Args:
        patterns: cc_codeline regular expressions; a call is kept when any of them
            ``re.search``-es the joined stack. Empty: every call is kept.
        skip_dirs: frames of files under these directories (ending in a separator) are left out.
        skip_pattern: frames whose file path this pattern searches are left out.
    """

    def __init__(
        self, patterns: Sequence[str] = (), skip_dirs: tuple[str, ...] = (), skip_pattern: str | None = None
    ) -> None:
        self._patterns = tuple(re.compile(p) for p in patterns)
        self._skip_dirs = skip_dirs
        self._skip_pattern = re.compile(skip_pattern) if skip_pattern else None
        self._skip: dict[CodeType, bool] = {}
        self._text: dict[Frame, str] = {}
        self._sites: dict[tuple[Frame, ...], str | None] = {}

    def _skipped(self, code: CodeType) -> bool:
        path = os.path.abspath(code.co_filename)
        pattern = self._skip_pattern
        return path.startswith(self._skip_dirs) or (pattern is not None and pattern.search(path) is not None)

    def frames(self) -> tuple[Frame, ...]:
        """The user frames of the current call, innermost first."""
        found = []
        frame = sys._getframe(1)
        skip = self._skip
        while frame is not None:
            code = frame.f_code
            skipped = skip.get(code)
            if skipped is None:
                skipped = skip[code] = self._skipped(code)
            if not skipped:
                found.append((code, frame.f_lineno))
            frame = frame.f_back
        return tuple(found)

    def render(self, frame: Frame) -> str:
        """``"{path}[{line}]   {function}"`` of one frame."""
        text = self._text.get(frame)
        if text is None:
            code, line = frame
            text = self._text[frame] = f"{code.co_filename}[{line}]   {code.co_name}"
        return text

    def stack(self, frames: Sequence[Frame]) -> str:
        """msprobe's stack string: rendered frames joined with ``;``."""
        return ";".join(self.render(f) for f in frames)

    def site(self, frames: tuple[Frame, ...]) -> str | None:
        """The call site label ``file[line]`` of a kept call, or None when cc_codeline filters it out.

        The label names the innermost frame that a pattern matches on its own, else (a pattern
        spanning frames) the innermost user frame. Without patterns every call is kept, with
        the innermost user frame as its site.
        """
        if frames in self._sites:
            return self._sites[frames]
        if len(self._sites) >= MAX_CACHED:
            self._sites.clear()
            self._text.clear()
        site = None
        if not self._patterns or any(p.search(self.stack(frames)) for p in self._patterns):
            chosen = next(
                (f for f in frames if any(p.search(self.render(f)) for p in self._patterns)),
                frames[0] if frames else None,
            )
            site = "?" if chosen is None else f"{os.path.basename(chosen[0].co_filename)}[{chosen[1]}]"
        self._sites[frames] = site
        return site
