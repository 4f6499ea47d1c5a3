"""Runtime: a task's shard operations as they run. :class:`~.loop.LoopRunner` runs a
``th.shard`` loop (a user's own, or a ``TaskLoop``'s), with the boundary crossing, autocast,
compilation and random streams of its ops."""
