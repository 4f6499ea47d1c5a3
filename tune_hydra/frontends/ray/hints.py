"""The driver's scheduling hints for the trials of one engine actor.

The driver's scheduler tells an engine, per trial, the iterations the trial still has
(``set_remaining``, for the LRTF policy) and the iterations to its next milestone
(``set_milestone``, for the milestone policy). A hint may come before its trial
registered or its function started, so it is kept here until the trial ends, and the
trial gets the hints that came first when it arrives.

This module imports neither torch nor the engine (trial processes import the actor).
"""

from __future__ import annotations

import threading
from typing import Any

NO_MILESTONE: Any = object()
"""No milestone announced for a trial (``None`` means: none left)."""


class TrialHints:
    """The latest hints of each trial, by trial id; safe to use from any thread (the
    actor's two event loops and its control pool).

    Example:
        >>> hints = TrialHints()
        >>> hints.set_remaining("t1", 5)
        >>> hints.get("t1") == (5, NO_MILESTONE)
        True
        >>> hints.set_milestone("t1", None)
        >>> hints.get("t1")
        (5, None)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._remaining: dict[str, int] = {}
        # Iterations to each trial's next milestone (None: none left), as last announced.
        self._milestones: dict[str, int | None] = {}

    def set_remaining(self, key: str, iterations: int) -> None:
        """Trial ``key`` has ``iterations`` left after those already granted."""
        with self._lock:
            self._remaining[key] = iterations

    def set_milestone(self, key: str, iterations: int | None) -> None:
        """Trial ``key``'s next milestone is ``iterations`` away (None: none left)."""
        with self._lock:
            self._milestones[key] = iterations

    def get(self, key: str) -> tuple[int | None, Any]:
        """``(remaining, milestone)`` of trial ``key``: ``remaining`` None and
        ``milestone`` :data:`NO_MILESTONE` where none was given."""
        with self._lock:
            return self._remaining.get(key), self._milestones.get(key, NO_MILESTONE)

    def forget(self, key: str) -> None:
        """Drop trial ``key``'s hints (it ended)."""
        with self._lock:
            self._remaining.pop(key, None)
            self._milestones.pop(key, None)
