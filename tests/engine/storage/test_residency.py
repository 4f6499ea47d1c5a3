"""Residency states: every allowed transition, the refused ones, and who may prefetch."""

from __future__ import annotations

import pytest
import torch

from tune_hydra.engine.storage import Residency, ResidencyError, ShardResidency

CPU = torch.device("cpu")
MOVES = ("lend", "arrive", "home", "retire", "spill", "load")


def _in(state: Residency, owner: object = None) -> ShardResidency:
    """A residency brought to ``state`` through allowed transitions."""
    r = ShardResidency()
    if state is Residency.IN_PLACE:
        r.lend(CPU, owner)
    elif state is Residency.DEVICE:
        r.arrive(CPU, owner)
    elif state is Residency.RETIRED:
        r.retire()
    elif state is Residency.DISK:
        r.spill()
    assert r.state is state
    return r


def _move(r: ShardResidency, move: str, owner: object) -> None:
    if move in ("lend", "arrive"):
        getattr(r, move)(CPU, owner)
    else:
        getattr(r, move)()


# (from, move) -> to; the pairs missing here must raise.
ALLOWED = {
    (Residency.HOST, "lend"): Residency.IN_PLACE,
    (Residency.HOST, "arrive"): Residency.DEVICE,
    (Residency.HOST, "home"): Residency.HOST,
    (Residency.HOST, "retire"): Residency.RETIRED,
    (Residency.IN_PLACE, "lend"): Residency.IN_PLACE,
    (Residency.IN_PLACE, "arrive"): Residency.DEVICE,
    (Residency.IN_PLACE, "home"): Residency.HOST,
    (Residency.IN_PLACE, "retire"): Residency.RETIRED,
    (Residency.DEVICE, "home"): Residency.HOST,
    (Residency.RETIRED, "lend"): Residency.IN_PLACE,
    (Residency.RETIRED, "arrive"): Residency.DEVICE,
    (Residency.RETIRED, "home"): Residency.RETIRED,
    (Residency.RETIRED, "retire"): Residency.RETIRED,
    (Residency.HOST, "spill"): Residency.DISK,
    (Residency.IN_PLACE, "spill"): Residency.DISK,
    (Residency.RETIRED, "spill"): Residency.DISK,
    (Residency.DISK, "load"): Residency.HOST,
    # On disk it stays there until loaded: a demotion or retirement finds it home.
    (Residency.DISK, "home"): Residency.DISK,
    (Residency.DISK, "retire"): Residency.DISK,
}


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("start", list(Residency), ids=lambda s: s.name)
def test_transitions(start: Residency, move: str) -> None:
    holder, taker = object(), object()
    r = _in(start, holder)
    target = ALLOWED.get((start, move))
    if target is None:
        with pytest.raises(ResidencyError, match=f"cannot {move} .* from {start.name}"):
            _move(r, move, taker)
        held = start in (Residency.IN_PLACE, Residency.DEVICE)
        assert r.state is start and r.owner is (holder if held else None)  # nothing changed
        return
    _move(r, move, taker)
    assert r.state is target
    at_work = target in (Residency.IN_PLACE, Residency.DEVICE)
    assert r.owner is (taker if at_work else None)
    assert r.device == CPU


def test_a_device_copy_knows_its_device_and_owner() -> None:
    worker = object()
    r = ShardResidency()
    meta = torch.device("meta")  # any device other than the host's
    r.arrive(meta, worker)
    assert r.device == meta and r.holds(meta, worker)
    assert not r.holds(CPU, worker) and not r.holds(meta, object())
    r.home()
    assert r.device == CPU and r.owner is None and not r.holds(meta, worker)


@pytest.mark.parametrize(
    ("state", "same_owner", "allowed"),
    [
        (Residency.HOST, False, True),
        (Residency.IN_PLACE, False, True),  # host memory in place: nobody's copy to take
        (Residency.DEVICE, True, True),
        (Residency.DEVICE, False, False),  # another worker may be computing with it
        (Residency.RETIRED, True, False),
        (Residency.DISK, False, True),  # read back from disk, then copied in
    ],
)
def test_who_may_prefetch(state: Residency, same_owner: bool, allowed: bool) -> None:
    holder = object()
    r = _in(state, holder)
    assert r.may_speculate(holder if same_owner else object()) is allowed


def test_a_state_spilled_while_retired_loads_back_retired() -> None:
    r = ShardResidency()
    r.retire()
    r.spill()
    assert r.state is Residency.DISK and not r.may_speculate(object())
    r.load()
    assert r.state is Residency.RETIRED
    r.spill()
    r.load()  # retired once: loaded once, then it is host memory as any other
    assert r.state is Residency.RETIRED


def test_retiring_on_disk_keeps_it_from_prefetches() -> None:
    r = ShardResidency()
    r.spill()
    assert r.may_speculate(object())
    r.retire()  # a checkpoint is being taken: no prefetch may take it to a device
    assert r.state is Residency.DISK and not r.may_speculate(object())
    r.load()
    assert r.state is Residency.RETIRED
