"""Runtime: a task's shard operations as they run. :class:`~.loop.LoopRunner` runs a user's
own loop (``th.shard``), :class:`~.runner.TaskRunner` a ``ModelTask``'s training; both run a
shard op through :mod:`.stage`, with the same boundary crossing, autocast and RNG streams."""
