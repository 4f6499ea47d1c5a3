"""Process-wide state of training libraries, made per thread for trials that are threads.

Trials of one engine process are threads (Ray Tune function trainables, ``th.optimize``'s
objectives, ``study.optimize(n_jobs=...)``). Hugging Face ``Trainer`` runs on Accelerate,
whose ``PartialState``, ``AcceleratorState`` and ``GradientState`` are process-wide
singletons (the Borg pattern: every instance's ``__dict__`` is one class-level dict): two
``Trainer`` s in two threads then share the gradient-accumulation state (one trial's
dataloader end ends the other's accumulation window) and the device setup, and one of
them trains differently from the same trial alone.

Accelerate ships a per-thread form of that dict for its multithreaded TPU mode
(``accelerate.state.ThreadLocalSharedDict``); :func:`isolate_library_state` installs it on
those classes, so each thread has its own states. The thread that installs it keeps the
dict it had (objects already made there, an ``Accelerator`` among them, still share state
with new ones); other threads start empty, as a fresh process would. So a ``Trainer``
built in one thread and trained in another (its dataloaders made there) no longer shares
its accumulation state with itself: build and train each ``Trainer`` in one thread, as
a trial (an objective, a function trainable) does.

Still process-wide, and so the same for every trial of one process: environment variables
(``TrainingArguments`` writes ``ACCELERATE_MIXED_PRECISION`` when ``bf16``/``fp16`` is
set: give every trial of a search the same precision), ``torch.backends`` flags (``tf32``),
``torch.use_deterministic_algorithms`` and Python's and NumPy's global random generators
(torch's is per trial: :func:`tune_hydra.engine.registration.factory.private_rng`).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


def isolate_library_state() -> bool:
    """Give each thread its own Accelerate states (idempotent; a no-op where Accelerate
    is not installed, and until ``transformers`` or ``accelerate`` is imported).

    Returns:
        Whether Accelerate's states are per thread now.
    """
    if "accelerate" not in sys.modules and "transformers" not in sys.modules:
        return False
    if importlib.util.find_spec("accelerate") is None:
        return False
    import accelerate.state as state

    local = getattr(state, "ThreadLocalSharedDict", None)
    if local is None:
        log.warning(
            "accelerate %s has no ThreadLocalSharedDict: Hugging Face Trainers in "
            "concurrent trials of one process share Accelerate's state",
            getattr(sys.modules.get("accelerate"), "__version__", "?"),
        )
        return False
    with _LOCK:
        for name in _ACCELERATE_STATES:
            cls = getattr(state, name, None)
            if cls is None:
                continue
            current = cls.__dict__.get("_shared_state")
            if isinstance(current, local):
                continue
            per_thread = local()
            if isinstance(current, dict):
                per_thread._storage = current  # this thread keeps its dict: its objects
            cls._shared_state = per_thread
    return True


__all__ = ["isolate_library_state"]
