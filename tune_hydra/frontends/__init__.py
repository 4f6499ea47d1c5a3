"""Front ends: what runs the engine for a search library. ``ray`` (Ray Tune: ``th.run``,
``HydraExecutor``), ``optuna`` (``th.optimize``, no Ray), and the kit they share, one
concept per module: ``build`` (a trial from its factory's task to an engine task),
``trial`` (a trial's model guarded in a shared process), ``checkpoint`` (saving and
restoring a trial; the checkpoint schema), ``failures`` (a trial's failure in words),
``common`` (the results a trial reports). See ``docs/frontends.md``."""
