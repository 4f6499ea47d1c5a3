"""The contract of every tune_hydra error (issue #30): it pickles intact, and it keeps
every base class it had (users catch ``ValueError``, ``MemoryError``, ... subclasses).

The classes are found, not listed: every ``TuneHydraError`` subclass defined anywhere
in the package, so a new one is held to the contract without touching this file.
"""

from __future__ import annotations

import errno
import importlib
import inspect
import json
import pathlib
import pickle
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest

import tune_hydra
from tune_hydra.exceptions import InvalidOptionError, TuneHydraError

# Each class's MRO (module.qualname), recorded before the errors were regrouped.
_BASES: dict[str, list[str]] = json.loads(
    (pathlib.Path(__file__).parent / "exception_bases.json").read_text()
)


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _all_errors() -> list[type[TuneHydraError]]:
    """Every TuneHydraError subclass defined in the package (all modules imported)."""
    for mod in pkgutil.walk_packages(tune_hydra.__path__, "tune_hydra."):
        importlib.import_module(mod.name)
    found = {c for c in _subclasses(TuneHydraError) if c.__module__.startswith("tune_hydra")}
    return sorted(found | {TuneHydraError}, key=_name)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _by_name(name: str) -> type:
    module, _, qualname = name.rpartition(".")
    found: type = getattr(importlib.import_module(module), qualname)
    return found


# A representative value for each constructor parameter, by name (then by annotation).
_EXAMPLES: dict[str, Any] = {
    "errors": {"a": ValueError("x")},
    "history": {"a": [], "b": [{"loss": 1.0}]},
    "tensors": [("0.weight", "1.weight"), ("2.bias", "2.bias")],
    "code": errno.EACCES,
    "min_device_memory": 3 << 20,
    "file": "model.pt",
    "fix": "Restore it from an earlier checkpoint",
    "value": float("nan"),
}
_BY_TYPE: dict[str, Any] = {"str": "a", "int": 7, "float": 1.5}


def _construct(cls: type[TuneHydraError]) -> TuneHydraError:
    """``cls`` built with representative arguments (a message where it takes one)."""
    if not inspect.isfunction(cls.__init__):  # the built-in exception's: a message
        return cls(f"{cls.__name__}: what went wrong. How to fix it.")
    args = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.name in _EXAMPLES:
            args.append(_EXAMPLES[p.name])
        elif str(p.annotation) in _BY_TYPE:
            args.append(_BY_TYPE[str(p.annotation)])
        else:
            raise AssertionError(f"add an example for {cls.__name__}({p.name}: {p.annotation})")
    return cls(*args)


_ERRORS = _all_errors()


def test_every_error_is_found_and_none_was_lost() -> None:
    found = {_name(c) for c in _ERRORS}
    assert set(_BASES) <= found, set(_BASES) - found  # no public class renamed or moved
    assert len(found) >= 72


@pytest.mark.parametrize("name", sorted(_BASES))
def test_every_base_class_of_today_is_kept(name: str) -> None:
    cls = _by_name(name)
    for base in _BASES[name]:
        assert issubclass(cls, _by_name(base)), f"{name} is no longer a {base}"


@pytest.mark.parametrize("cls", _ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_pickles_intact(cls: type[TuneHydraError]) -> None:
    err = _construct(cls)
    back = pickle.loads(pickle.dumps(err))  # Ray ships errors between processes
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args and str(err)
    public = {k: v for k, v in vars(err).items() if not k.startswith("_")}
    assert set(vars(back)) == set(vars(err))
    for key, value in public.items():
        if key in cls._reprs:  # the user's value stands in as its repr
            assert repr(getattr(back, key)) == repr(value)
        elif isinstance(value, dict) and any(isinstance(v, BaseException) for v in value.values()):
            assert {k: (type(v), str(v)) for k, v in getattr(back, key).items()} == {
                k: (type(v), str(v)) for k, v in value.items()
            }
        else:
            assert getattr(back, key) == value or value != value, key  # nan != nan
    back.add_note("kept")  # still a working exception
    assert pickle.loads(pickle.dumps(back)).__notes__ == ["kept"]


def test_a_value_that_does_not_pickle_travels_as_its_repr() -> None:
    err = InvalidOptionError("seed", lambda: 0, "give an int", "task 'a'")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and repr(back.value) == repr(err.value)
    assert (back.option, back.expected, back.where) == ("seed", "give an int", "task 'a'")
