"""Any ``nn.Module`` cut into sequential stages by tracing its ``forward`` with torch.fx.

``torch.fx.symbolic_trace`` records ``forward`` as a graph: calls of the model's
submodules (``torch.nn`` layers are leaves; the user's own container classes are traced
through), functions (``F.relu``, ``torch.flatten``, ``+``), tensor methods (``view``) and
reads of parameters or buffers. :func:`trace_layers` cuts that graph before every
submodule call, so each stage is one submodule call with the functions that follow it
(``conv1`` + ``relu``, ``pool`` + ``flatten`` ...). A stage takes the values live at its
start (one value bare, several as a tuple) and returns those live after it; the last
stage returns what ``forward`` returns. A skip connection (``x = x + self.block(x)``)
thus carries ``x`` through the stages between its fork and its join.

The stages hold the user's own submodules and parameters, not copies: training them
trains the model, whose ``state_dict()`` keeps its keys. A parameter or buffer that
``forward`` reads itself (``self.alpha * x``, ``self.mask[:t, :t]``) is held by the stage
that reads it: parameters stay the same objects; such buffers are read-only inputs.

A ``forward`` that reads ``self.training`` (``F.dropout(x, p, training=self.training)``)
is traced in both modes, and each stage runs the graph of its current mode.

Traced for a call (``trace_layers(model, call=TracedCall...)``, what ``th.shard`` does
on the model's first forward): ``forward`` gets that call's arguments, positional and
keyword, defaults applied, nested tuples/lists/dicts as they are; each tensor in them is
an input of the graph (the first stage takes them in order: bare when one, else a
tuple), everything else (``None``, Python scalars, strings) is a constant of the graph,
so ``if mask is not None`` and ``if return_dict`` follow the call traced. The output may
be any pytree (tuple, list, dict, namedtuple, ``None`` leaves, a registered dataclass).
Without a call (a task factory's model), ``forward`` gets the batch's inputs as its one
argument and its other arguments keep their defaults.

Limits: ``forward`` must be traceable (no control flow on tensor values) and must call
the same submodules in train and eval mode. A module with parameters called in two
stages shares them between the stages (see :mod:`tune_hydra.engine.registration.shared`).

``torch.fx.passes.split_module`` is not used: it wires every value straight from the
partition that makes it to the ones that use it, while the engine runs stages in a
line, one boundary at a time, so values have to be carried through the stages between.
"""

from __future__ import annotations

import enum
import inspect
import linecache
import math
import operator
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from tune_hydra.exceptions import InvalidModelError, UnsupportedCallError

_TORCH_DIR = os.path.dirname(torch.__file__)
_CONTROL_FLOW = "symbolically traced variables cannot be used as inputs to control flow"


def trace_layers(
    model: nn.Module, task: str | None = None, *, call: TracedCall | None = None
) -> list[tuple[str, nn.Module]]:
    """Cut ``model`` into stages by tracing its ``forward``; see the module docstring.

    Args:
        model: any ``nn.Module`` whose ``forward`` takes the batch's inputs as its one
            argument (more arguments need defaults; they keep them), or, with ``call``,
            the arguments of that call.
        task: the task's name, for errors.
        call: the call to trace (:func:`bind_call`): the first stage then takes that
            call's tensors (``bind_call``'s inputs) and the last returns ``forward``'s
            output as it is.

    Returns:
        ``(name, stage)`` in execution order. A stage's name is the submodule it calls
        (``"conv1"``, ``"blocks.0.fc"``; ``"pool:2"`` for a second call of ``pool``), or
        ``"forward"`` for a model that calls no submodule.

    Raises:
        InvalidModelError: ``forward`` cannot be traced (data-dependent control flow and
            the like: the message names the construct and its line), calls other
            submodules in train and eval mode, or takes more than one input without
            defaults.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torch.nn.functional as F
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        ...     def forward(self, x):
        ...         return x + self.fc2(F.relu(self.fc1(x)))
        >>> net = Net()
        >>> stages = trace_layers(net)
        >>> [name for name, _ in stages]
        ['fc1', 'fc2']
        >>> x = torch.randn(2, 4)
        >>> carry = stages[0][1](x)  # fc1's output and x, for the skip connection
        >>> torch.equal(stages[1][1](carry), net(x))
        True
    """
    of = f"task {task!r}: " if task is not None else ""
    with _mode(model, True):
        train, train_spec = _trace(model, of, call)
    with _mode(model, False):
        evaluate, eval_spec = _trace(model, of, call)
    stages = _cut(model, train, of, train_spec)
    if train.python_code("self").src == evaluate.python_code("self").src and (
        train_spec == eval_spec
    ):
        return stages
    # forward reads self.training (F.dropout(x, p, training=self.training)): a traced
    # graph fixes the mode, so each stage runs the graph traced in its current mode.
    others = _cut(model, evaluate, of, eval_spec)
    if [n for n, _ in others] != [n for n, _ in stages]:
        raise InvalidModelError(
            f"{of}{type(model).__name__}.forward reads self.training and calls other "
            f"submodules in train and eval mode ({_calls(stages)} vs {_calls(others)}), so "
            f"one cut cannot serve both. Call the same submodules in both modes (a module "
            f"for what depends on the mode, such as nn.Dropout(p)), or give the model as "
            f"an nn.Sequential of its layers in the order forward runs them"
        )
    return [(n, ModeStage(t, e)) for (n, t), (_, e) in zip(stages, others, strict=True)]


class ModeStage(nn.Module):
    """A stage of a ``forward`` that reads ``self.training``: the graph traced in train
    mode while training, the one traced in eval mode otherwise. Both hold the same
    modules and parameters of the user's.

    Args:
        train: the stage traced in train mode.
        evaluate: the same stage traced in eval mode.
    """

    def __init__(self, train: nn.Module, evaluate: nn.Module) -> None:
        super().__init__()
        self.train_graph = train
        self.eval_graph = evaluate
        direct = getattr(train, "direct_layer", None)
        if direct is not None:
            object.__setattr__(self, "direct_layer", direct)

    def forward(self, inputs: Any) -> Any:
        return (self.train_graph if self.training else self.eval_graph)(inputs)


def _calls(stages: list[tuple[str, nn.Module]]) -> str:
    names = [n for n, _ in stages]
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


# -- calls -----------------------------------------------------------------------------------

_CONSTANTS: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    slice,
    range,
    type(Ellipsis),
)
"""What a traced call may hold besides tensors: values a graph can keep as constants.
Anything else (an object holding tensors) would be baked into the graph as the first
call's, so it is refused."""


class TracedCall:
    """One call of a model's ``forward`` as a trace sees it (made by :func:`bind_call`):
    the arguments bound to ``forward``'s signature with its defaults applied, flattened
    as a pytree; its tensors are the graph's inputs (placeholders), the other leaves its
    constants.

    Attributes:
        owner: the model's class name, for messages.
        placeholders: the graph inputs' names, one per tensor, in order.
    """

    def __init__(
        self,
        signature: inspect.Signature,
        names: list[str],
        leaves: list[Any],
        spec: Any,
        tensor_at: list[int],
        owner: str,
    ) -> None:
        self.signature = signature
        self.owner = owner
        self._names = names  # each leaf's place in the call (``mask``, ``pair['a'][0]``)
        self._leaves = leaves  # the constants; None where a tensor goes
        self._spec = spec
        self._tensor_at = tensor_at
        taken: set[str] = set()
        self.placeholders = []
        for i in tensor_at:
            base = re.sub(r"\W+", "_", names[i]).strip("_") or "arg"
            if base[0].isdigit() or base in taken:
                base = f"{base}_{i}"
            taken.add(base)
            self.placeholders.append(base)

    def arguments(self, tensors: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` for ``forward`` (without ``self``): the call with
        ``tensors`` (the trace's proxies) where its tensors were."""
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors, strict=True):
            leaves[i] = t
        bound = inspect.BoundArguments(self.signature, tree_unflatten(leaves, self._spec))
        return bound.args, bound.kwargs

    def describe(self) -> str:
        """``x=<tensor>, mask=None, scale=0.5``: the call, as the trace sees it."""
        at = set(self._tensor_at)
        shown = [
            f"{n}=<tensor>" if i in at else f"{n}={v!r}"
            for i, (n, v) in enumerate(zip(self._names, self._leaves, strict=True))
        ]
        return ", ".join(shown) or "no arguments"

    def check_same(self, other: TracedCall) -> None:
        """Refuse ``other`` (a later call) unless its non-tensor arguments, and where its
        tensors are, equal this call's (the one traced): the graph holds them as its
        constants, so another value would silently compute with this call's.

        Raises:
            UnsupportedCallError: they differ (the message shows both calls).
        """
        if (
            other._spec == self._spec
            and other._tensor_at == self._tensor_at
            and all(_same_constant(a, b) for a, b in zip(self._leaves, other._leaves, strict=True))
        ):
            return
        if other._spec == self._spec:  # name what changed
            at, later = set(self._tensor_at), set(other._tensor_at)
            changed = [
                f"{n}={'<tensor>' if i in later else repr(b)} where the first call had "
                f"{'<tensor>' if i in at else repr(a)}"
                for i, (n, a, b) in enumerate(
                    zip(self._names, self._leaves, other._leaves, strict=True)
                )
                if (i in at) != (i in later) or not _same_constant(a, b)
            ]
            what = "this call gives " + ", ".join(changed)
        else:
            what = f"this call is forward({other.describe()})"
        raise UnsupportedCallError(
            f"a sharded {self.owner} was cut by tracing its first call, forward("
            f"{self.describe()}); {what}. The trace "
            f"holds the first call's arguments that are not tensors (None, Python scalars, "
            f"strings, and which arguments are tensors) as constants, so this call would "
            f"compute with them: call the model with the same non-tensor arguments every "
            f"time (a value that changes can be passed as a tensor, e.g. "
            f"torch.tensor(0.5), where forward does not branch on it), or shard one model "
            f"per kind of call"
        )


def bind_call(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any], owner: str
) -> tuple[TracedCall, Any]:
    """``forward``'s arguments (``signature`` without ``self``) as a traced call, and the
    first stage's input: the call's tensors in order, bare when one, else a tuple.

    Raises:
        TypeError: the arguments do not fit the signature (as calling ``forward``
            would: a missing or unexpected argument).
        UnsupportedCallError: an argument holds something that is neither a tensor nor
            a constant (:data:`_CONSTANTS`): an object of another class (a batch class
            holding tensors) that the trace would keep as the first call's.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    flat, spec = tree_flatten_with_path(dict(bound.arguments))
    names = [_place(path) for path, _ in flat]
    tensor_at = [i for i, (_, v) in enumerate(flat) if isinstance(v, torch.Tensor)]
    for n, (_, v) in zip(names, flat, strict=True):
        if not isinstance(v, (torch.Tensor, *_CONSTANTS)):
            raise UnsupportedCallError(
                f"a sharded {owner} got {n}={type(v).__name__}(...): th.shard passes a "
                f"traced model tensors (in tuples, lists and dicts) and constants (None, "
                f"numbers, strings), and cannot see the tensors inside a "
                f"{type(v).__name__}. Pass its tensors as arguments, or register the class "
                f"as a pytree (torch.export.register_dataclass for a dataclass, "
                f"torch.utils._pytree.register_pytree_node otherwise)"
            )
    leaves = [None if isinstance(v, torch.Tensor) else v for _, v in flat]
    call = TracedCall(signature, names, leaves, spec, tensor_at, owner)
    tensors = [flat[i][1] for i in tensor_at]
    return call, tensors[0] if len(tensors) == 1 else tuple(tensors)


def _place(path: tuple[Any, ...]) -> str:
    """``pair['a'][0]`` for the leaf at ``path`` in the bound arguments' dict."""
    head = getattr(path[0], "key", path[0]) if path else "?"
    return f"{head}{keystr(path[1:])}"


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):  # True == 1, but a trace of True may branch differently
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a is b or bool(a == b)


def _unknown_output(owner: str, path: tuple[Any, ...], leaf: Any) -> str:
    where = keystr(path) or "itself"
    cls = type(leaf).__name__
    return (
        f"{owner}.forward returns a {cls} (its output's {where}), which torch's pytree does "
        f"not know, so th.shard cannot hand its tensors from the last shard to the "
        f"backward. Return a tuple, list or dict (or a namedtuple), or register {cls} as "
        f"a pytree (torch.export.register_dataclass({cls}) for a dataclass, "
        f"torch.utils._pytree.register_pytree_node otherwise)"
    )


# -- tracing -------------------------------------------------------------------------------


@contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` (every submodule) in train or eval mode, restored afterwards."""
    saved = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _trace(model: nn.Module, of: str, call: TracedCall | None = None) -> tuple[fx.Graph, Any]:
    """``torch.fx`` tracing of ``model.forward``: of ``call``, or with the arguments that
    have defaults fixed to them. Returns the graph and, for a call, the output's
    ``TreeSpec`` (the graph returns the output's leaves), else ``None``."""
    name = type(model).__name__
    concrete: dict[str, Any] = {}
    if call is None:
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):  # a builtin forward: let fx find out
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        concrete = {
            p.name: p.default
            for p in params[1:]
            if p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY)
            and p.default is not inspect.Parameter.empty
        }
    tracer = _OwnThreadTracer(call)
    # Buffers as graph values too (``self.mask[:t, :t]`` with ``t`` from the input's
    # shape), not constants that Python-level indexing by a traced value fails on.
    tracer.proxy_buffer_attributes = True
    try:
        with _TRACE_LOCK:
            return tracer.trace(model, concrete_args=concrete or None), tracer.out_spec
    except InvalidModelError:  # ours, about the call or the output: already explained
        raise
    except Exception as err:
        raise InvalidModelError(f"{of}{_untraceable(name, err)}") from err


_TRACE_LOCK = threading.Lock()
"""One trace at a time: each patches ``nn.Module`` for the whole process and restores
what it found, so two at once would leave one's patch installed for good."""


class _OwnThreadTracer(fx.Tracer):
    """A tracer that records only its own thread.

    While it traces, torch.fx replaces ``nn.Module.__call__`` and ``__getattr__`` for the
    whole process. In the engine's process other threads are running other tasks' modules
    at that moment (a trial registers while others train); their calls must run as usual,
    not be recorded into this graph (torch.fx then fails them with "module is not
    installed as a submodule").
    """

    def __init__(self, call: TracedCall | None = None) -> None:
        super().__init__()
        self._owner = threading.get_ident()
        self.call = call
        self.out_spec: Any = None  # the output's TreeSpec, when tracing a call

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        call = self.call
        if call is None or not is_module:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        # One placeholder per tensor of the call; forward gets the call's own containers
        # and constants (so len(), iteration, `is None` and branches on flags are plain
        # Python), and returns its output's leaves, whose structure is kept aside.
        proxies = [self.create_proxy("placeholder", n, (), {}) for n in call.placeholders]

        def traced(root: nn.Module) -> list[Any]:
            args, kwargs = call.arguments(proxies)
            out = root_fn(root, *args, **kwargs)
            flat, self.out_spec = tree_flatten_with_path(out)
            for path, leaf in flat:
                if not isinstance(leaf, (fx.Proxy, torch.Tensor, *_CONSTANTS)):
                    raise InvalidModelError(_unknown_output(call.owner, path, leaf))
            return [leaf for _, leaf in flat]

        return traced, [self.root]

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if threading.get_ident() != self._owner:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self._owner:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # peft's adapter layers (lora.Linear ...) branch on their input's dtype: each is
        # called as one layer, as torch.nn's are (see tune_hydra.models.peft).
        return type(m).__module__.startswith("peft.") or super().is_leaf_module(
            m, module_qualified_name
        )


def _untraceable(name: str, err: BaseException) -> str:
    """Why ``forward`` could not be traced, where, and what to do about it."""
    where = _user_frame(err)
    text = str(err).strip().splitlines()
    first = text[0] if text else type(err).__name__
    if _CONTROL_FLOW in str(err):
        construct = (
            "data-dependent control flow (an if, while, assert or bool() on a tensor's value)"
        )
        fix = (
            "Make the branch not depend on tensor values (decide it from a constructor "
            "argument), or give the model as an nn.Sequential (or a list of modules) of "
            "its layers in the order forward runs them"
        )
    else:
        construct = f"a construct torch.fx cannot trace ({type(err).__name__}: {first})"
        fix = (
            "Rewrite that line with tensor operations torch.fx can record (no Python "
            "logic on tensor values, no iteration over a tensor), or give the model as an "
            "nn.Sequential (or a list of modules) of its layers in the order forward runs "
            "them"
        )
    return (
        f"{name}.forward cannot be cut into shards: tracing it with torch.fx failed on "
        f"{construct}{where}. {fix}"
    )


def _user_frame(err: BaseException) -> str:
    """`` at FILE:LINE in FUNC: `source` `` for the innermost frame of the traceback that
    is not torch's own (the user's line that fx stopped at), or ``""``."""
    found = ""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_TORCH_DIR) and code.co_filename != __file__:
            source = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            shown = f": `{source}`" if source else ""
            found = f" at {code.co_filename}:{tb.tb_lineno} in {code.co_name}{shown}"
        tb = tb.tb_next
    return found


# -- cutting ---------------------------------------------------------------------------------


def _is_assert(node: fx.Node) -> bool:
    """fx's check that an argument fixed by ``concrete_args`` still has its value."""
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith(
        "_assert_is_none"
    )


def _cut(
    model: nn.Module, graph: fx.Graph, of: str, out_spec: Any = None
) -> list[tuple[str, nn.Module]]:
    """The stages of ``graph``; ``out_spec``: it was traced for a call (every placeholder
    is one of the call's tensors, the output node lists the output's leaves)."""
    name = type(model).__name__
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    if out_spec is not None and not placeholders:
        raise InvalidModelError(
            f"{of}{name} was called without a tensor argument (only None, Python scalars "
            f"or strings): th.shard runs the model's layers on the call's tensors. Pass "
            f"the batch's tensors to forward"
        )
    if not placeholders:
        raise InvalidModelError(
            f"{of}{name}.forward takes no input; the engine calls model(inputs) with each "
            f"batch's inputs: give forward one argument"
        )
    sources = placeholders if out_spec is not None else placeholders[:1]
    # Without a call, the arguments after the first: fixed to their defaults (None, by
    # concrete_args, with an assertion node that is dropped here); one that forward uses
    # without a default cannot be given, since the engine passes the batch's inputs alone.
    constants: dict[fx.Node, Any] = {}
    for ph in placeholders[len(sources) :]:
        users = [u for u in ph.users if not _is_assert(u)]
        if not users:
            continue
        if not ph.args:
            raise InvalidModelError(
                f"{of}{name}.forward uses its argument {str(ph.target).lstrip('*')!r}, "
                f"which has no default; the engine calls model(inputs) with the batch's "
                f"inputs alone. Give it a default, or take a tuple of inputs as the first "
                f"argument"
            )
        constants[ph] = ph.args[0]
    body = [
        n for n in nodes if n.op not in ("placeholder", "output", "get_attr") and not _is_assert(n)
    ]
    if not body:
        raise InvalidModelError(
            f"{of}{name}.forward returns its input as is: it has no layers to cut or "
            f"train. Give the model its layers (submodules forward calls), or pass them as "
            f"an nn.Sequential"
        )

    # One group per submodule call, with the functions that follow it (those before the
    # first call join the first group).
    groups: list[list[fx.Node]] = []
    names: list[str | None] = []
    for n in body:
        if n.op == "call_module":
            if groups and names[-1] is None:
                names[-1] = str(n.target)
            else:
                groups.append([])
                names.append(str(n.target))
        elif not groups:
            groups.append([])
            names.append(None)
        groups[-1].append(n)
    stage_names = _unique([nm or "forward" for nm in names])

    last = len(groups) - 1
    stage_of: dict[fx.Node, int] = dict.fromkeys(sources, -1)
    for k, group in enumerate(groups):
        for n in group:
            stage_of[n] = k

    def last_use(n: fx.Node) -> int:
        uses = [last if u is output else stage_of.get(u, -1) for u in n.users]
        return max(uses, default=-1)

    carried = [*sources, *body]
    ends = {n: last_use(n) for n in carried}
    # The values each stage gets: made before it, used at or after it.
    live_in: list[list[fx.Node]] = [list(sources)] + [
        [n for n in carried if stage_of[n] < k <= ends[n]] for k in range(1, len(groups))
    ]

    stages: list[tuple[str, nn.Module]] = []
    for k, group in enumerate(groups):
        outs: Any = None if k == last else live_in[k + 1]
        stages.append(
            (
                stage_names[k],
                _stage(model, group, live_in[k], outs, output, constants, k == 0, out_spec),
            )
        )
    return stages


def _unique(names: list[str]) -> list[str]:
    """``["pool", "fc", "pool"]`` -> ``["pool", "fc", "pool:2"]``."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}:{seen[n]}")
    return out


def _stage(
    model: nn.Module,
    group: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node] | None,
    output: fx.Node,
    constants: dict[fx.Node, Any],
    first: bool,
    out_spec: Any = None,
) -> fx.GraphModule:
    """One stage: a ``GraphModule`` of ``group``'s nodes over the user's own modules and
    tensors, taking ``inputs`` (bare when one) and returning ``outputs`` (bare when one;
    ``None``: the model's output, rebuilt from its leaves by ``out_spec`` when given)."""
    g = fx.Graph()
    env: dict[fx.Node, Any] = dict(constants)
    root: dict[str, Any] = {}
    arg = g.placeholder("x" if first else "inputs")
    if len(inputs) == 1:
        env[inputs[0]] = arg
    else:
        for i, n in enumerate(inputs):
            env[n] = g.create_node("call_function", operator.getitem, (arg, i), name=n.name)

    def value(n: fx.Node) -> Any:
        if n not in env:
            if n.op != "get_attr":
                raise AssertionError(f"{n} is not live in this stage")  # a bug of ours
            env[n] = _get_attr(model, g, root, str(n.target))
        return env[n]

    for n in group:
        if n.op == "call_module":
            root[str(n.target)] = model.get_submodule(str(n.target))
        for a in n.all_input_nodes:
            value(a)
        env[n] = g.node_copy(n, value)
    if outputs is None:
        result = fx.graph.map_arg(output.args[0], value)
        if out_spec is not None:  # the output's structure, as forward returned it
            root["_th_out_spec"] = out_spec
            result = g.call_function(tree_unflatten, (result, g.get_attr("_th_out_spec")))
        g.output(result)
    elif len(outputs) == 1:
        g.output(value(outputs[0]))
    else:
        g.output(tuple(value(n) for n in outputs))
    g.lint()
    stage = fx.GraphModule(root, g, class_name="Stage")
    head = group[0]
    if head.op == "call_module" and len(inputs) == 1 and head.args and head.args[0] is inputs[0]:
        # The stage's input goes into this module as is: errors on the input can be
        # explained by it (a Linear's in_features, a Conv's channels). Not registered as
        # a submodule again (it is one already, under its own name).
        object.__setattr__(stage, "direct_layer", root[str(head.target)])
    return stage


def _get_attr(model: nn.Module, g: fx.Graph, root: dict[str, Any], target: str) -> fx.Node:
    """A read of ``model``'s tensor ``target`` (a parameter or buffer read in ``forward``
    itself, not through a module call) in the stage's graph ``g``.

    The stage holds the tensor under a flat name of its own (``attr_blocks_0_mask``), so
    that the user's modules are never touched and no other tensor of the owning module
    comes along: a parameter is the same ``nn.Parameter`` (the engine moves its data and
    steps it in place; one read in two shards is shared by them), a buffer the same
    tensor, which each stage reading it moves on its own: such buffers are read-only
    inputs (masks, position tables). One written in place by ``forward`` would not be
    written back to the model from a device.
    """
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    base = "attr_" + target.replace(".", "_")
    flat, k = base, 1
    while flat in root and root[flat] is not obj:
        k += 1
        flat = f"{base}_{k}"
    root[flat] = obj
    return g.get_attr(flat)
