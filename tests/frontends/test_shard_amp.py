"""th.shard under mixed precision: the user's ``torch.autocast`` reaches every shard op.

The user's autocast is thread-local and the shards run on the engine's device threads:
each op enters the state of the thread that asked for it (the forward's, the backward's,
the forward's again for a recompute). References are the same loop on a
``copy.deepcopy`` without ``th.shard``; the weights are float32 (autocast's input), so
"exact" is ``torch.equal`` of every per-step loss and every final weight, and each test
also checks the run differs from full precision (the autocast was not dropped).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import assert_same, batches
from tune_hydra.engine.runtime import amp
from tune_hydra.exceptions import UnsupportedPrecisionError

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


@pytest.fixture(params=["recompute", "kept"])
def engine(request: pytest.FixtureRequest) -> Iterator[th.Engine]:
    """2 emulated copying devices, at most 2 layers a shard; recomputing or keeping graphs."""
    eng = th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=2,
        recompute=request.param == "recompute",
    )
    yield eng
    eng.close()


def net() -> nn.Sequential:
    """Three shards at 2 layers a shard; LayerNorm (autocast's fp32 list on the CPU) and
    dropout (the recompute replays its numbers) between bf16 matmuls."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.LayerNorm(32),
        nn.Dropout(0.1),
        nn.Linear(32, 4),
    )


def data(n: int = 4) -> list[Any]:
    return batches(n, dtype=torch.float32)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    autocast: dict[str, Any] | None,
    *,
    backward_inside: bool = False,
) -> list[torch.Tensor]:
    losses = []
    for x, y in data():
        opt.zero_grad()
        with torch.autocast(**autocast) if autocast else torch.autocast("cpu", enabled=False):
            out = model(x)
            loss = F.cross_entropy(out, y)
            if backward_inside:  # a common form: backward inside the autocast block
                loss.backward()
        if not backward_inside:
            loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def plain_and_sharded(
    engine: th.Engine, autocast: dict[str, Any] | None, **kw: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], nn.Module, nn.Module]:
    model = net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(3)
    want = train(ref, ref_opt, autocast, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(3)
    got = train(model, opt, autocast, **kw)
    return want, got, ref, model


@pytest.mark.parametrize(
    "backward_inside", [False, True], ids=["backward-after", "backward-inside"]
)
def test_bf16_autocast_is_exactly_plain_bf16(engine: th.Engine, backward_inside: bool) -> None:
    want, got, ref, model = plain_and_sharded(engine, BF16, backward_inside=backward_inside)
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert_same(ref, model)
    assert got[0].dtype == torch.float32  # cross_entropy is on autocast's fp32 list
    # ... and it is bf16 compute, not fp32: the full-precision run differs.
    full, _, _, _ = plain_and_sharded(engine, None)
    assert not all(torch.equal(a, b) for a, b in zip(full, got, strict=True))


def test_eval_under_autocast_is_plain(engine: th.Engine) -> None:
    model = net()
    ref = copy.deepcopy(model)
    model, _ = th.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), engine=engine)
    model.eval()
    ref.eval()
    x = data(1)[0][0]
    with torch.no_grad(), torch.autocast(**BF16):
        got, want = model(x), ref(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    with torch.no_grad():
        assert model(x).dtype == torch.float32  # the autocast left with its block


def test_autocast_disabled_inside_a_region_is_honoured(engine: th.Engine) -> None:
    """``autocast(enabled=False)`` nested in an enabled one: full precision for that
    forward, as plain."""
    model = net()
    ref = copy.deepcopy(model)
    model, _ = th.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), engine=engine)
    x = data(1)[0][0]
    with torch.autocast(**BF16), torch.autocast("cpu", enabled=False):
        torch.manual_seed(5)
        got = model(x)
        torch.manual_seed(5)
        want = ref(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_the_state_enters_and_leaves() -> None:
    assert amp.current() is None
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        state = amp.current()
        with amp.entered(None):  # a recompute of a forward that ran without autocast
            assert not torch.is_autocast_enabled("cpu")
    assert state == amp.Autocast((("cpu", torch.float16),), cache=False)
    with amp.entered(state):
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert not torch.is_autocast_cache_enabled()
    assert not torch.is_autocast_enabled("cpu")


def test_an_autocast_that_cannot_reach_the_devices_raises() -> None:
    """``autocast("cpu")`` around a model whose shards run on GPUs would compute them in
    fp32 without a word: refused with the fix."""
    state = amp.Autocast((("cpu", torch.bfloat16),))
    amp.check_device(state, torch.device("cpu"))  # the device type it is for: fine
    with pytest.raises(UnsupportedPrecisionError, match=r"torch\.autocast\('cuda'"):
        amp.check_device(state, torch.device("cuda", 0))


def scaled_train(
    model: nn.Module, opt: torch.optim.Optimizer, *, clip: bool
) -> tuple[list[torch.Tensor], list[float]]:
    """fp16 autocast with a GradScaler whose first scales overflow (skipped steps)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    losses, scales = [], []
    for x, y in data(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:  # the documented form: unscale_, then clip the real gradients
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        scales.append(scaler.get_scale())
    return losses, scales


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_fp16_grad_scaler_is_exactly_plain(engine: th.Engine, clip: bool, fused: bool) -> None:
    """The scaler sees every shard's gradients: the same inf checks (the same steps
    skipped, the same scale schedule) and the same unscaled steps as plain."""
    model = net()
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    want, want_scales = scaled_train(
        ref, torch.optim.Adam(ref.parameters(), lr=1e-2, fused=fused), clip=clip
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(3)
    got, got_scales = scaled_train(model, opt, clip=clip)
    assert got_scales == want_scales
    assert want_scales[0] < 2.0**24  # the first steps overflowed and were skipped
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert_same(ref, model)


def test_hugging_face_bf16_autocast_loop_is_exactly_plain(engine: th.Engine) -> None:
    """A GPT-2 (float32, ``from_config``) fine-tuned under bf16 autocast with a warmup
    schedule: the sharded per-step losses are plain bf16's, not fp32's."""
    from tests.frontends.test_shard import gpt2, lm_data

    transformers = pytest.importorskip("transformers")

    def run(model: nn.Module, opt: torch.optim.Optimizer, autocast: bool) -> list[torch.Tensor]:
        sched = transformers.get_linear_schedule_with_warmup(opt, 1, 4)
        losses = []
        for batch in lm_data(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        return losses

    model = gpt2().float()
    ref, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(3)  # dropout
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), True)
    torch.manual_seed(3)
    full = run(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-2), False)
    model, opt = th.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), engine=engine)
    torch.manual_seed(3)
    got = run(model, opt, True)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert not torch.equal(got[-1], full[-1])
    assert_same(ref, model)


def gpu_net() -> nn.Sequential:
    """No dropout: the GPU's own generator is not what this checks."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-scaler"])
def test_cuda_autocast_is_exactly_plain(dtype: torch.dtype) -> None:
    """On a GPU: ``autocast("cuda")`` (bf16; fp16 with a GradScaler) around a loop whose
    shards the engine copies to the GPU equals the plain loop on that GPU."""
    data_ = [(x.cuda(), y.cuda()) for x, y in data(6)]

    def run(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[float], list[float]]:
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**20, enabled=dtype == torch.float16)
        losses, scales = [], []
        for x, y in data_:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        return losses, scales

    ref = gpu_net().cuda()
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    eng = th.Engine(devices="cuda", device_memory="1GiB", max_layers_per_shard=2)
    try:
        model = gpu_net()
        model, opt = th.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), engine=eng)
        assert run(model, opt) == want
        for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b.cpu())
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_autocast_around_gpu_shards_raises() -> None:
    """``autocast("cpu")`` has no effect on the GPU the shards run on: refused, never a
    silent fp32 run."""
    eng = th.Engine(devices="cuda", device_memory="1GiB", max_layers_per_shard=2)
    try:
        model = gpu_net()
        model, _ = th.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), engine=eng)
        x = data(1)[0][0]
        with torch.autocast(**BF16), pytest.raises(UnsupportedPrecisionError):
            model(x)
    finally:
        eng.close()


def test_a_bf16_model_trains_in_bf16_as_plain(engine: th.Engine) -> None:
    """``model.to(torch.bfloat16)`` before th.shard: weights, gradients and optimizer
    state stay bf16 (nothing upcast on the way to a device and back)."""
    model = net().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = th.shard(model, opt, engine=engine)
    for m, o in ((ref, ref_opt), (model, opt)):
        torch.manual_seed(3)
        for x, y in batches(3, dtype=torch.bfloat16):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    assert_same(ref, model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = opt.state_dict()["state"]
    assert {v.dtype for st in state.values() for k, v in st.items() if k != "step"} == {
        torch.bfloat16
    }
