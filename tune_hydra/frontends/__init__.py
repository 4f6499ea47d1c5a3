"""Front ends: what runs the engine for a search library. ``ray`` (Ray Tune: ``th.run``,
``HydraExecutor``), ``optuna`` (``th.optimize``, no Ray), and what they share
(``common``: checks, result keys, budget hints; ``checkpoint``: the checkpoint files)."""
