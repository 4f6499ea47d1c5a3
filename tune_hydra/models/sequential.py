"""An ``nn.Sequential`` cut as written: its children in order, nested ones flattened."""

from __future__ import annotations

from torch import nn

from tune_hydra.exceptions import InvalidModelError


def sequential_layers(model: nn.Sequential, task: str | None = None) -> list[tuple[str, nn.Module]]:
    """The children of ``model`` in order, as ``(qualified name, module)``.

    Nested ``nn.Sequential`` containers are flattened so the partitioner may cut inside
    them; any other child is one indivisible layer.

    Args:
        model: the task's model.
        task: the task's name, for errors.

    Returns:
        The layers in execution order; names are the state-dict prefixes (``"0"``,
        ``"2.1"`` ...).

    Raises:
        InvalidModelError: ``model`` has no layers.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
        >>> [name for name, _ in sequential_layers(net)]
        ['0', '1.0', '1.1']
    """
    layers: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, seq: nn.Sequential) -> None:
        for name, child in seq.named_children():
            qual = f"{prefix}{name}"
            if type(child) is nn.Sequential:
                visit(qual + ".", child)
            else:
                layers.append((qual, child))

    visit("", model)
    if not layers:
        of = f"task {task!r}: " if task is not None else ""
        raise InvalidModelError(f"{of}model has no layers; give it at least one module")
    return layers
