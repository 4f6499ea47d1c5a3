"""A trial's failure as every front end reports it (``tune_hydra.frontends.failures``)."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from tests.conftest import mlp
from tune_hydra.exceptions import (
    EngineError,
    InvalidModelError,
    NotATaskError,
    ShardTooLargeError,
    SystematicTaskError,
    TaskFactoryError,
    UncuttableModelError,
)
from tune_hydra.frontends.failures import (
    RUNS_THE_LOOP,
    error_text,
    not_a_task,
    portable,
    uncuttable,
)


class _Unpicklable(RuntimeError):
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("cannot pickle")


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else x


def test_not_a_task_is_systematic_only_where_every_trial_repeats_it() -> None:
    err = not_a_task("t1", None)
    assert isinstance(err, NotATaskError) and isinstance(err, TaskFactoryError)
    assert err.trial == "t1" and "returned NoneType, not a tune_hydra.ModelTask" in err.problem
    assert "function trainable passed by mistake" in err.problem and RUNS_THE_LOOP in err.fix
    assert "experiment stops at the first one" in str(err)
    called = not_a_task("t2", 3, trainable="tune.report")
    assert "it calls tune.report(...)" in str(called) and "drop trial_executor" in str(called)
    one = not_a_task("7", None, takes="trial", systematic=False)
    assert type(one) is TaskFactoryError and not isinstance(one, SystematicTaskError)
    assert str(one).startswith("trial 7: the task factory returned NoneType")
    assert "make_task(trial) must" in str(one) and "function trainable" not in str(one)
    for e in (err, called):
        again = pickle.loads(pickle.dumps(e))  # crosses to the trial's process intact
        assert type(again) is type(e) and str(again) == str(e)


def test_uncuttable_only_for_a_model_type_the_engine_cannot_cut() -> None:
    refused = InvalidModelError("cannot be traced")
    err = uncuttable("t", _Branchy(), refused)
    assert isinstance(err, UncuttableModelError) and isinstance(err, InvalidModelError)
    assert "cannot be traced" in str(err) and "the other trials go on" in str(err)
    too_big = ShardTooLargeError("0", 10, 5)
    assert uncuttable("t", mlp(), too_big) is too_big  # this config's sizes: as it is


def test_error_text_keeps_the_type_and_cuts_long_errors() -> None:
    assert error_text(ValueError("bad")) == "ValueError: bad"
    long = error_text(ValueError("x" * 100), limit=20)
    assert long.startswith("ValueError: xxxxxxxx") and long.endswith("is in the log)")
    assert len(error_text(ValueError("x" * 100), limit=None)) == len("ValueError: ") + 100


def test_portable_keeps_what_pickles_and_explains_what_does_not() -> None:
    plain = ValueError("fine")
    assert portable(plain) is plain
    try:
        try:
            raise KeyError("in the user's code")
        except KeyError as cause:
            raise _Unpicklable("boom") from cause
    except _Unpicklable as err:
        shipped = portable(err)
    assert isinstance(shipped, EngineError)
    text = str(pickle.loads(pickle.dumps(shipped)))
    assert text.startswith("_Unpicklable: boom") and "in the user's code" in text
    assert "Original traceback" in text
