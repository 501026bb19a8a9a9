"""fp8func.kernels: the twins against an independent oracle (CPU), the Triton kernels against
their twins bitwise (GPU, eager and compiled).

The oracle below is written from the scale convention alone (reshape into groups, frexp for
the power-of-two round-up), not from fp8func's helpers, so a wrong twin fails here.
"""

import copy
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8func as f8
import fp8func.kernels as fk
from fp8func.kernels import _configs, _dispatch, _reference

from .models import ResidualMlp
from .strategies import tensors

ROW, B1, B128 = f8.AxisWise(-1), f8.BlockWise((1, 128)), f8.BlockWise((128, 128))
GRANULARITIES = [f8.TensorWise(), ROW, B1, B128]
FP8 = [f8.E4M3, f8.E5M2]


def _blocks(g, shape):
    """Group lengths along (rows, cols) of a 2-D ``shape``."""
    m, k = shape
    if isinstance(g, f8.TensorWise):
        return m, k
    if isinstance(g, f8.AxisWise):
        return (1, k) if g.axis in (-1, 1) else (m, 1)
    return g.block


def oracle(x, spec, scale=None):
    """(data, scale) of the cast, from the definition: groups by reshape, pow2 by frexp."""
    m, k = x.shape
    bm, bk = _blocks(spec.granularity, (m, k))
    g = x.float().reshape(m // bm, bm, k // bk, bk)
    fmax = torch.finfo(spec.dtype).max
    if scale is None:
        amax = g.abs().amax(dim=(1, 3))  # NaN propagates
        scale = amax.clamp(min=1e-12) * torch.tensor(1.0 / fmax)
        if spec.power_of_2:
            mant, exp = torch.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
            pow2 = torch.where(mant == 0.5, scale, torch.ldexp(torch.ones_like(scale), exp))
            scale = torch.where(torch.isfinite(scale), pow2, scale)
    recip = (1.0 / scale.double()).float()
    data = (g * recip[:, None, :, None]).clamp(-fmax, fmax).reshape(m, k).to(spec.dtype)
    return data, scale


def bits(t):
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_bitwise(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    diff = bits(got) != bits(want)
    if diff.any():
        i = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} differ; first at {i}: "
                             f"got {got[i].item()} ({bits(got)[i].item():#x}), "
                             f"want {want[i].item()} ({bits(want)[i].item():#x})")


def assert_same_q(q, data, scale, what):
    assert_bitwise(q.data, data, what + ".data")
    assert_bitwise(q.scale, scale, what + ".scale")


def shapes_for(g):
    if g == B128:
        return st.tuples(st.integers(1, 2), st.integers(1, 3)).map(lambda s: (128 * s[0], 128 * s[1]))
    if g == B1:
        return st.tuples(st.sampled_from([1, 37, 128, 256]), st.integers(1, 3).map(lambda j: 128 * j))
    return st.tuples(st.integers(1, 70), st.integers(1, 70))


cases = st.sampled_from(GRANULARITIES).flatmap(
    lambda g: st.tuples(st.just(g), tensors(shapes_for(g), specials=True), st.sampled_from(FP8), st.booleans()))


# --------------------------------------------------------------------------------------------
# CPU: the twins (and the dispatcher around them) against the oracle.


@given(case=cases, transpose=st.booleans())
def test_quantize_twin_matches_oracle(case, transpose):
    g, x, dtype, p2 = case
    spec = f8.CastSpec(dtype, g, p2)
    transpose = transpose and (g != B1 or x.shape[0] % 128 == 0)
    q, q_t = fk.quantize(x, spec, transpose=transpose)  # auto on the CPU: the twin
    assert q.meta == f8.Fp8Meta(spec, x.dtype)
    assert_same_q(q, *oracle(x, spec), "q")
    if transpose:
        assert q_t.meta == q.meta and q_t.shape == (x.shape[1], x.shape[0])
        assert_same_q(q_t, *oracle(x.t().contiguous(), spec), "q_t")
    else:
        assert q_t is None


@given(case=cases, shift=st.integers(-3, 8))
def test_cast_twin_matches_oracle(case, shift):
    g, x, dtype, p2 = case
    spec = f8.CastSpec(dtype, g, p2)
    # Scales 2**shift times too small saturate; the others leave headroom.
    _, scale = oracle(x, spec)
    scale = scale * 2.0**-shift
    transpose = g != B1 or x.shape[0] % 128 == 0
    scale_t = oracle(x.t().contiguous(), spec)[1] * 2.0**-shift if transpose else None
    data, data_t = fk.cast(x, scale, spec, transpose=transpose, scale_t=scale_t)
    assert_bitwise(data, oracle(x, spec, scale)[0], "data")
    if transpose:
        assert_bitwise(data_t, oracle(x.t().contiguous(), spec, scale_t)[0], "data_t")


def test_cast_round_to_is_the_cast_of_the_rounded_tensor():
    """round_to=bf16 (FSDP2's hook on an fp32 master): the cast of x.to(bf16), bitwise; other
    combinations raise, naming the fix."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * 3
    x[0, :4] = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -9, float("nan"), float("inf")])  # ties, specials
    spec = f8.CastSpec()
    scale = torch.full((1, 1), 1 / 64)
    got = fk.cast(x, scale, spec, transpose=True, round_to=torch.bfloat16)
    want = fk.cast(x.to(torch.bfloat16), scale, spec, transpose=True)
    assert_bitwise(got[0], want[0], "data")
    assert_bitwise(got[1], want[1], "data_t")
    with pytest.raises(ValueError, match="rounding applies to float32 x and torch.bfloat16"):
        fk.cast(x.bfloat16(), scale, spec, round_to=torch.float16)


@given(x=tensors(st.tuples(st.integers(1, 70), st.integers(1, 70)), specials=True), dtype=st.sampled_from(FP8),
       shift=st.integers(-3, 8), transpose=st.booleans())
def test_cast_amax_twin_matches_oracle(x, dtype, shift, transpose):
    """Delayed scaling's cast: the data of a cast with a given scale (one that saturates with
    shift > 0) and the amax the oracle computes, NaN as the standard quiet NaN."""
    spec = f8.CastSpec(dtype)
    scale = oracle(x, spec)[1] * 2.0**-shift
    data, data_t, amax = fk.cast_amax(x, scale, spec, transpose=transpose)
    assert_bitwise(data, oracle(x, spec, scale)[0], "data")
    if transpose:
        assert_bitwise(data_t, oracle(x.t().contiguous(), spec, scale)[0], "data_t")
    else:
        assert data_t is None
    want = x.float().abs().amax().reshape(1, 1)
    want = torch.where(want.isnan(), torch.tensor(0x7FC00000, dtype=torch.int32).view(torch.float32), want)
    assert_bitwise(amax, want, "amax")


@pytest.mark.parametrize("g", [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.AxisWise(1)], ids=repr)
def test_amax_twin(g):
    x = torch.randn(33, 65)
    x[4, 7] = float("nan")
    x[9, 3] = -float("inf")
    want = {f8.TensorWise(): x.abs().amax().reshape(1, 1), f8.AxisWise(0): x.abs().amax(0, keepdim=True)}.get(
        g, x.abs().amax(1, keepdim=True))
    got = fk.amax(x, g)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert (bits(got)[got.isnan()] == 0x7FC00000).all() and got.isnan().any()  # the standard quiet NaN


@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("bad", ["nan", "inf", "zeros"])
def test_twin_edge_values(g, bad):
    x = torch.randn(256, 256)
    if bad == "zeros":
        x.zero_()
    else:
        x[130, 5] = float("nan") if bad == "nan" else float("inf")
    spec = f8.CastSpec(f8.E4M3, g, True)
    q, q_t = fk.quantize(x, spec, transpose=True)
    assert_same_q(q, *oracle(x, spec), "q")
    assert_same_q(q_t, *oracle(x.t().contiguous(), spec), "q_t")
    if bad == "zeros":
        assert (q.data.float() == 0).all() and torch.isfinite(q.scale).all()
    else:  # exactly the group holding (130, 5) has a non-finite scale
        where = {f8.TensorWise(): (0, 0), ROW: (130, 0), B1: (130, 0), B128: (1, 0)}[g]
        expected = torch.zeros_like(q.scale, dtype=torch.bool)
        expected[where] = True
        assert torch.equal(~torch.isfinite(q.scale), expected)


def test_transposed_casts_are_what_the_specs_say():
    x = torch.randn(256, 384) * torch.logspace(-3, 3, 384)  # columns of very different size
    tw, blk, row = (f8.CastSpec(f8.E4M3, g) for g in (f8.TensorWise(), B128, ROW))
    q, q_t = fk.quantize(x, tw, transpose=True)
    assert torch.equal(bits(q_t.data), bits(q.data.t())) and torch.equal(q_t.scale, q.scale)
    q, q_t = fk.quantize(x, blk, transpose=True)
    assert torch.equal(bits(q_t.data), bits(q.data.t())) and torch.equal(q_t.scale, q.scale.t())
    q, q_t = fk.quantize(x, row, transpose=True)  # per-column scales: a different cast
    assert q_t.scale.shape == (384, 1) and not torch.equal(bits(q_t.data), bits(q.data.t()))
    data, data_t = fk.cast(x, q.scale, row, transpose=True, scale_t=q_t.scale)
    assert torch.equal(bits(data), bits(q.data)) and torch.equal(bits(data_t), bits(q_t.data))


def test_auto_picks_the_twin_off_cuda_and_compiles():
    x = torch.randn(64, 256)
    assert _dispatch._backend("auto", x) is _reference
    assert _dispatch._backend("reference", x) is _reference
    spec = f8.CastSpec(f8.E4M3, B1, True)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: fk.quantize(t, spec, transpose=False), fullgraph=True, backend="aot_eager")
    q, _ = fn(x)
    ref, _ = fk.quantize(x, spec, impl="reference")
    assert_same_q(q, ref.data, ref.scale, "compiled")


def test_errors_name_the_value_and_the_fix():
    x = torch.randn(64, 256)
    spec = f8.CastSpec()
    with pytest.raises(ValueError, match=r"shape \(2, 64, 256\).*reshape"):
        fk.quantize(torch.randn(2, 64, 256), spec)
    with pytest.raises(ValueError, match="contiguous=False"):
        fk.quantize(x.t(), spec)
    with pytest.raises(ValueError, match="torch.float16"):
        fk.cast(x.half(), torch.ones(1, 1), spec)
    with pytest.raises(ValueError, match=r"MX\(block=32, axis=-1\) has no kernel"):
        fk.quantize(x, f8.CastSpec(granularity=f8.MX(32)))
    with pytest.raises(ValueError, match=r"AxisWise\(axis=0\) has no kernel"):
        fk.quantize(x, f8.CastSpec(granularity=f8.AxisWise(0)))
    with pytest.raises(ValueError, match=r"BlockWise\(block=\(1, 128\)\) does not divide a tensor of shape \(256, 64"):
        fk.quantize(x, f8.CastSpec(granularity=B1), transpose=True)
    with pytest.raises(ValueError, match=r"scale is \(\(64, 1\).*expected float32 of shape \(1, 1\)"):
        fk.cast(x, torch.ones(64, 1), spec)
    with pytest.raises(ValueError, match=r"pass scale_t of shape \(256, 1\)"):
        fk.cast(x, torch.ones(64, 1), f8.CastSpec(granularity=ROW), transpose=True)
    with pytest.raises(ValueError, match=r"cast_amax: spec=.*AxisWise.*expected a CastSpec with TensorWise"):
        fk.cast_amax(x, torch.ones(64, 1), f8.CastSpec(granularity=ROW))
    with pytest.raises(ValueError, match=r"cast: scale is \(\(64, 1\).*expected float32 of shape \(1, 1\)"):
        fk.cast_amax(x, torch.ones(64, 1), spec)
    with pytest.raises(ValueError, match=r"impl='cuda': expected one of"):
        fk.amax(x, f8.TensorWise(), impl="cuda")
    with pytest.raises((RuntimeError, ValueError), match="impl='triton' needs"):
        fk.amax(x, f8.TensorWise(), impl="triton")  # no triton here, or a CPU tensor


def test_configs_are_frozen_and_overrides_checked_and_undone():
    cfg = _configs.Config(bm=64, bk=128, warps=4, raw_t=True)
    with pytest.raises(TypeError):
        _configs.CONFIGS["cast_t"] = cfg  # a read-only mapping
    with _configs.override("cast_t", cfg):
        assert _configs.config("cast_t") is cfg and _configs.config("cast") == _configs.CONFIGS["cast"]
        with _configs.override("cast_t", _configs.CONFIGS["cast_t"]):
            assert _configs.config("cast_t") == _configs.CONFIGS["cast_t"]
        assert _configs.config("cast_t") is cfg
    assert _configs.config("cast_t") == _configs.CONFIGS["cast_t"]
    with pytest.raises(ValueError):  # the override is undone when the block raises
        with _configs.override("cast_t", cfg):
            raise ValueError
    assert _configs.config("cast_t") == _configs.CONFIGS["cast_t"]


@pytest.mark.parametrize(("route", "cfg", "match"), [
    ("cast_x", _configs.Config(8, 8, 4), r"route 'cast_x': expected one of"),
    ("cast", _configs.Config(48, 128, 4), r"powers of two"),
    ("cast", _configs.Config(8, 1024, 8, stages=0), r"stages at least 1"),
    ("cast", _configs.Config(8, 1024, 8, unroll=1), r"unroll applies to the slab walks"),
    ("cast", _configs.Config(8, 1024, 8, raw_t=True), r"raw_t applies to the transposing routes"),
    ("cast_block", _configs.Config(8, 256, 8), r"bk dividing 128"),
    ("cast_block_t", _configs.Config(256, 64, 8), r"bm and bk dividing 128"),
    ("block_1x128", _configs.Config(16, 64, 4), r"bk=128"),
    ("block_128", _configs.Config(64, 128, 4), r"bm=bk=128"),
    ("block_128_t", _configs.Config(64, 64, 4), r"bm=128 and bk dividing 128"),
    ("rowwise", _configs.Config(4096, 128, 4), r"bk=0"),
    ("amax_flat", _configs.Config(2, 4096, 4), r"bm=1"),
])
def test_config_check_names_what_the_route_needs(route, cfg, match):
    with pytest.raises(ValueError, match=match), _configs.override(route, cfg):
        pass


# the variable inductor's compile workers read the static-launch setting from (the user's to set)
STATIC_ENV_VAR = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def test_static_launches_turns_inductors_static_launcher_on_unless_set():
    # A fresh process each: the setting is process-wide. Default: on after the call, in this
    # process and, through the environment, in the processes started after it (inductor's compile
    # workers take it from there); set by the user in code or by the environment: that choice
    # stands, and the workers get the user's value.
    code = ("import os, subprocess, sys\n"
            "import torch._inductor.config as c\n"
            "from fp8func.kernels._configs import static_launches\n"
            "{pre}on = static_launches()\n"
            "worker = subprocess.run([sys.executable, '-c', 'import torch._inductor.config as c; "
            "print(c.static_launch_user_defined_triton_kernels)'], capture_output=True, text=True, check=True)\n"
            "print(on, c.static_launch_user_defined_triton_kernels, os.environ.get('{env_var}'),\n"
            "      worker.stdout.strip())")

    def run(pre="", env=None):
        full = {k: v for k, v in os.environ.items() if k != STATIC_ENV_VAR} | (env or {})
        out = subprocess.run([sys.executable, "-c", code.format(pre=pre, env_var=STATIC_ENV_VAR)], env=full,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run() == ["True", "True", "1", "True"]
    assert run(pre="c.static_launch_user_defined_triton_kernels = False\n") == ["False", "False", "0", "False"]
    assert run(env={STATIC_ENV_VAR: "0"}) == ["False", "False", "0", "False"]
    assert run(env={STATIC_ENV_VAR: "1"}) == ["True", "True", "1", "True"]


def test_sweep_candidates_are_runnable_and_include_the_frozen_configs():
    """The sweep (a GPU tool) imports on the CPU, covers every route, and each candidate passes
    the route's check; the frozen configuration is among them, so a re-sweep can keep it."""
    from fp8func.bench import _sweep

    assert set(_sweep.CANDIDATES) == set(_sweep.CALLS) == set(_configs.CONFIGS)
    for route, cands in _sweep.CANDIDATES.items():
        for cfg in cands:
            _configs.check(route, cfg)
        assert _configs.CONFIGS[route] in cands, route
        assert len(set(cands)) == len(cands), route


# --------------------------------------------------------------------------------------------
# GPU: every Triton kernel against its twin, bitwise, on the same CUDA tensor.

needs_triton = pytest.mark.skipif(not fk.triton_available(), reason="needs the triton package")
COMBOS = [(torch.bfloat16, f8.E4M3, True), (torch.float32, f8.E5M2, False),
          (torch.bfloat16, f8.E5M2, False), (torch.float32, f8.E4M3, True)]
SHAPES = {  # per granularity: ragged shapes exercise the masks
    "tw": [(1, 1), (37, 53), (300, 1000), (1024, 4096), (4097, 515)],
    "row": [(1, 1), (37, 53), (300, 1000), (1024, 4096), (129, 14336), (8, 16512), (3, 40000)],
    "b1": [(1, 128), (37, 256), (256, 384), (1024, 4096), (4097, 640)],
    "b128": [(128, 128), (256, 384), (1024, 4096), (640, 2048)],
}
KEY = {f8.TensorWise(): "tw", ROW: "row", B1: "b1", B128: "b128"}


def _gpu_input(shape, dtype, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * 2.0 ** (seed % 40 - 20)
    m, k = shape
    if kind == "specials" and x.numel() > 4:
        x[0, 0] = float("nan")
        x[m // 2, k // 3] = -float("nan")
        x[m - 1, k - 1] = float("inf")
        x[m // 3, k - 1] = -float("inf")
        x[m // 2] = 0.0  # a zero row
        x[:, k // 2] *= 1e-38  # fp32 subnormals (bf16 keeps some)
        x[m - 1, 0] = 3.0e38  # near the fp32 max
    elif kind == "zeros":
        x.zero_()
    return x.to(dtype)


def _check_quantize(x, spec, transpose, run):
    q, q_t = run(x, spec, transpose, "triton")
    r, r_t = fk.quantize(x, spec, transpose=transpose, impl="reference")
    assert_same_q(q, r.data, r.scale, "q")
    if transpose:
        assert_same_q(q_t, r_t.data, r_t.scale, "q_t")


def _eager(x, spec, transpose, impl):
    return fk.quantize(x, spec, transpose=transpose, impl=impl)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-{c[1]}-p2={c[2]}".replace("torch.", ""))
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kind", ["randn", "specials", "zeros"])
def test_triton_quantize_bitwise_twin(g, combo, transpose, kind):
    dtype, fp8, p2 = combo
    spec = f8.CastSpec(fp8, g, p2)
    for i, shape in enumerate(SHAPES[KEY[g]]):
        if transpose and g == B1 and shape[0] % 128:
            continue
        if kind == "zeros" and i % 2:
            continue
        _check_quantize(_gpu_input(shape, dtype, kind, i), spec, transpose, _eager)


# The +T block routes' launch layouts (the sweep picks one, the tests above run that one): the
# 128x128 tile walked in [128, bk] slabs, unrolled or as loops, the transposed copy from the fp32
# or the raw tile.
BLOCK_T_LAYOUTS = [dict(bk=64, warps=4), dict(bk=64, warps=2, unroll=1), dict(bk=32, warps=4),
                   dict(bk=16, warps=8), dict(bk=32, warps=8, unroll=2), dict(bk=16, warps=4, unroll=1),
                   dict(bk=64, warps=2, unroll=1, raw_t=True), dict(bk=64, warps=4, raw_t=True),
                   dict(bk=32, warps=4, raw_t=True)]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", [B1, B128], ids=repr)
@pytest.mark.parametrize("layout", BLOCK_T_LAYOUTS, ids=lambda d: "-".join(f"{k}{int(v)}" for k, v in d.items()))
def test_triton_block_t_every_layout_bitwise_twin(g, layout):
    route = "block_128_t" if g == B128 else "block_1x128_t"
    with _configs.override(route, _configs.Config(bm=128, **layout)):
        for combo in COMBOS[:2]:  # bf16 -> E4M3 pow2, fp32 -> E5M2 (the suite above runs all four)
            spec = f8.CastSpec(combo[1], g, combo[2])
            for i, shape in enumerate(s for s in SHAPES[KEY[g]] if s[0] % 128 == 0 and s[0] * s[1] < 2**20):
                for kind in ("randn", "specials"):
                    _check_quantize(_gpu_input(shape, combo[0], kind, i), spec, True, _eager)


@pytest.mark.gpu
@needs_triton
def test_triton_block_t_random_shapes_bitwise_twin():
    """The +T block kernels in their frozen configurations on random whole-block shapes, every
    input/format combo, NaN and zero rows: the miscompiles of docs/kernels.md ("Known limits")
    depend on the specialization."""
    rng = random.Random(0)
    for trial in range(12):
        m, k = 128 * rng.randint(1, 24), 128 * rng.randint(1, 24)
        for dtype, fp8, p2 in COMBOS:
            x = (torch.randn(m, k, device="cuda") * 2.0 ** rng.randint(-20, 20)).to(dtype)
            if trial % 3 == 0:
                x[rng.randrange(m), rng.randrange(k)] = float("nan")
                x[rng.randrange(m)] = 0.0
            for g in (B1, B128):
                _check_quantize(x, f8.CastSpec(fp8, g, p2), True, _eager)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("combo", COMBOS[:2], ids=lambda c: f"{c[0]}-{c[1]}".replace("torch.", ""))
@pytest.mark.parametrize("scales", ["saturating", "extreme"])
def test_triton_cast_bitwise_twin(g, combo, scales):
    dtype, fp8, p2 = combo
    spec = f8.CastSpec(fp8, g, p2)
    for i, shape in enumerate(SHAPES[KEY[g]]):
        x = _gpu_input(shape, dtype, "specials" if i % 2 else "randn", i)
        transpose = not (g == B1 and shape[0] % 128)
        r, r_t = fk.quantize(x, spec, transpose=transpose, impl="reference")
        s, s_t = r.scale, (r_t.scale if transpose else None)
        if scales == "saturating":
            s, s_t = s / 64, (s_t / 64 if transpose else None)
        else:  # huge (reciprocal subnormal), tiny (x * recip overflows), inf, NaN
            pick = torch.tensor([2.0**127, 3.0e38, 1e-30, float("inf"), float("nan"), 1.5], device="cuda")
            s = pick[torch.arange(s.numel(), device="cuda") % 6].reshape(s.shape)
            s_t = pick[torch.arange(s_t.numel(), device="cuda") % 5].reshape(s_t.shape) if transpose else None
        got = fk.cast(x, s, spec, transpose=transpose, scale_t=s_t, impl="triton")
        want = fk.cast(x, s, spec, transpose=transpose, scale_t=s_t, impl="reference")
        assert_bitwise(got[0], want[0], f"{shape} data")
        if transpose:
            assert_bitwise(got[1], want[1], f"{shape} data_t")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_cast_round_to_bf16_bitwise_twin(transpose):
    """The kernel's in-register fp32 -> bf16 rounding (FSDP2's hook on fp32 masters): bitwise
    the twin, which casts x.to(bf16), for every shape family and the special values."""
    spec = f8.CastSpec()
    for i, shape in enumerate(SHAPES["tw"]):
        x = _gpu_input(shape, torch.float32, "specials" if i % 2 else "randn", i)
        x.view(-1)[::7] = x.view(-1)[::7].bfloat16().float() * (1 + 2.0 ** -8)  # bf16 rounding ties
        scale = torch.full((1, 1), 2.0 ** (i - 3), device="cuda")  # some shapes saturate
        got = fk.cast(x, scale, spec, transpose=transpose, round_to=torch.bfloat16, impl="triton")
        want = fk.cast(x, scale, spec, transpose=transpose, round_to=torch.bfloat16, impl="reference")
        assert_bitwise(got[0], want[0], f"{shape} data")
        if transpose:
            assert_bitwise(got[1], want[1], f"{shape} data_t")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("route", ["cast_t", "cast_amax_t", "cast_block_t"])
@pytest.mark.parametrize("raw_t", [False, True])
@pytest.mark.parametrize("tile", [(64, 64, 4), (64, 128, 4), (64, 256, 8)],
                         ids=lambda t: "x".join(map(str, t)))
def test_triton_cast_transposed_every_layout_bitwise_twin(route, raw_t, tile):
    """The transposing casts (given scales, with amax, 1x128 blocks; tensorwise and row-wise
    quantize+T take ``cast_t`` too) in the tiles the frozen configurations use, the transposed
    copy made from the fp32 tile or from the raw one (``Config.raw_t``)."""
    bm, bk, warps = tile
    if route == "cast_block_t" and (128 % bm or 128 % bk):
        pytest.skip(f"{bm}x{bk} tiles straddle 1x128 groups (the route refuses them)")
    with _configs.override(route, _configs.Config(bm, bk, warps, raw_t=raw_t)):
        _check_transposed_casts(route)


def _check_transposed_casts(route):
    for dtype, fp8, p2 in COMBOS[:2]:
        for i, shape in enumerate([(37, 53), (256, 384), (1024, 4096), (4097, 640)]):
            x = _gpu_input(shape, dtype, "specials" if i % 2 else "randn", i)
            if route == "cast_t":
                for g in (f8.TensorWise(), ROW):
                    _check_quantize(x, f8.CastSpec(fp8, g, p2), True, _eager)
                spec = f8.CastSpec(fp8)
                s = fk.amax(x, f8.TensorWise(), impl="reference").nan_to_num(1.0) / 64 + 1e-30
                got, want = (fk.cast(x, s, spec, transpose=True, scale_t=s, impl=impl)
                             for impl in ("triton", "reference"))
            elif route == "cast_amax_t":
                spec = f8.CastSpec(fp8)
                s = torch.full((1, 1), 0.01, device="cuda")
                got, want = (fk.cast_amax(x, s, spec, transpose=True, impl=impl) for impl in ("triton", "reference"))
            else:
                if shape[0] % 128 or shape[1] % 128:
                    continue
                spec = f8.CastSpec(fp8, B1, p2)
                r, r_t = fk.quantize(x, spec, transpose=True, impl="reference")
                got, want = (fk.cast(x, r.scale / 4, spec, transpose=True, scale_t=r_t.scale / 4, impl=impl)
                             for impl in ("triton", "reference"))
            for name, a, b in zip(("data", "data_t", "amax"), got, want):
                assert_bitwise(a, b, f"{route} {shape} {dtype} {name}")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-{c[1]}".replace("torch.", ""))
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_cast_amax_bitwise_twin(combo, transpose, compiled):
    dtype, fp8, _ = combo
    spec = f8.CastSpec(fp8)
    torch._dynamo.reset()
    run = lambda t, s: fk.cast_amax(t, s, spec, transpose=transpose)  # noqa: E731
    run = torch.compile(run, fullgraph=True) if compiled else run
    for i, shape in enumerate(SHAPES["tw"] + [(16384, 4096)]):
        for kind in ("randn", "specials", "zeros"):
            x = _gpu_input(shape, dtype, kind, i)
            scale = fk.amax(x, f8.TensorWise(), impl="reference").nan_to_num(1.0) / 64 + 1e-30  # saturates
            got, want = run(x, scale), fk.cast_amax(x, scale, spec, transpose=transpose, impl="reference")
            for name, a, b in zip(("data", "data_t", "amax"), got, want):
                if b is None:
                    assert a is None
                else:
                    assert_bitwise(a, b, f"{shape} {kind} {name}")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("tile", [(32, 256, 8), (8, 1024, 8), (64, 128, 4), (128, 64, 4)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_cast_amax_every_tile_bitwise_twin(tile, transpose):
    """The per-tile maxima the cast leaves reduce to the twin's amax in every tile shape, edge
    tiles (whose masked-off elements load 0) included."""
    route = "cast_amax_t" if transpose else "cast_amax"
    spec = f8.CastSpec(f8.E4M3)
    with _configs.override(route, _configs.Config(*tile)):
        for i, shape in enumerate(SHAPES["tw"]):
            for kind in ("randn", "specials"):
                x = _gpu_input(shape, torch.bfloat16, kind, i)
                s = torch.full((1, 1), 0.01, device="cuda")
                got = fk.cast_amax(x, s, spec, transpose=transpose, impl="triton")
                want = fk.cast_amax(x, s, spec, transpose=transpose, impl="reference")
                for name, a, b in zip(("data", "data_t", "amax"), got, want):
                    if b is not None:
                        assert_bitwise(a, b, f"{shape} {kind} {name}")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_amax_bitwise_twin(g, dtype):
    for i, shape in enumerate([(1, 1), (37, 53), (4097, 515), (4096, 8192)]):
        for kind in ("randn", "specials", "zeros"):
            x = _gpu_input(shape, dtype, kind, i)
            assert_bitwise(fk.amax(x, g, impl="triton"), fk.amax(x, g, impl="reference"), f"{shape} {kind}")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_quantize_empty_bitwise_twin(g, transpose):
    """No kernel runs on an empty input; the scales are still the twin's (those of amax 0)."""
    spec = f8.CastSpec(f8.E4M3, g, True)
    for shape in [(0, 256), (256, 0)]:
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        _check_quantize(x, spec, transpose, _eager)
        if isinstance(g, f8.TensorWise):  # delayed scaling's cast: no kernel, the amax of nothing is 0
            got = fk.cast_amax(x, torch.ones(1, 1, device="cuda"), spec, transpose=transpose, impl="triton")
            want = fk.cast_amax(x, torch.ones(1, 1, device="cuda"), spec, transpose=transpose, impl="reference")
            for a, b in zip(got, want):
                assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b))


_STATIC_CHECK = """
import sys, torch, fp8func as f8, fp8func.kernels as fk
import torch._inductor.config as c
sys.path.insert(0, {examples!r})
from compile_launch_cost import launchers
c.compile_threads = 2  # kernels compiled in worker processes, as on any machine of several cores
c.fx_graph_cache = False
spec = f8.CastSpec(f8.E4M3)
f = torch.compile(lambda t: [q.data for q in fk.quantize(t, spec, transpose=True)], fullgraph=True)
f(torch.randn(384, 640, device="cuda", dtype=torch.bfloat16))
print(launchers())
"""


@pytest.mark.gpu
@needs_triton
def test_compiled_kernels_launch_statically_from_compile_workers():
    # Inductor compiles in worker processes, which read the static-launch setting from their
    # environment: fp8func's kernels launch through inductor's static launcher there too, and
    # through Triton's launcher where the user sets the variable to 0. A fresh process each.
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if not hasattr(CachingAutotuner, "is_statically_launchable"):
        pytest.skip("this torch's CachingAutotuner cannot say how it launches")

    def run(value=None):
        env = {k: v for k, v in os.environ.items() if k != STATIC_ENV_VAR} | ({STATIC_ENV_VAR: value} if value else {})
        code = _STATIC_CHECK.format(examples=str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    assert run() == "[('_amax_flat_kernel', True), ('_cast_kernel', True)]"
    assert run("0") == "[('_amax_flat_kernel', False), ('_cast_kernel', False)]"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
def test_triton_compiled_fullgraph_bitwise_twin(g):
    from fp8func.kernels import _triton_quant

    torch._dynamo.reset()
    x = _gpu_input((512, 1024), torch.bfloat16, "specials", 7)
    assert _dispatch._backend("auto", x) is _triton_quant
    spec = f8.CastSpec(f8.E4M3, g, True)
    quant = torch.compile(lambda t: fk.quantize(t, spec, transpose=True), fullgraph=True)
    _check_quantize(x, spec, True, lambda t, s, tr, impl: quant(t))
    r, r_t = fk.quantize(x, spec, transpose=True, impl="reference")
    cast = torch.compile(lambda t, s, s_t: fk.cast(t, s, spec, transpose=True, scale_t=s_t), fullgraph=True)
    data, data_t = cast(x, r.scale / 8, r_t.scale / 8)
    want = fk.cast(x, r.scale / 8, spec, transpose=True, scale_t=r_t.scale / 8, impl="reference")
    assert_bitwise(data, want[0], "data")
    assert_bitwise(data_t, want[1], "data_t")
    if not isinstance(g, f8.BlockWise):
        amax = torch.compile(lambda t: fk.amax(t, g), fullgraph=True)
        assert_bitwise(amax(x), fk.amax(x, g, impl="reference"), "amax")


def test_cast_many_is_each_tensor_cast_and_checks_its_arguments():
    """The reference path of ``cast_many`` (the GPU kernel is checked against it below):
    per tensor bitwise ``cast``, views shaped like the inputs; wrong arguments raise with the fix."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g), torch.randn(3, 32, generator=g) * 100, torch.empty(0, 16)]
    scales = torch.tensor([[0.01, 0, 0, 0], [0.5, 0, 0, 0], [1.0, 0, 0, 0]])
    spec = f8.CastSpec(f8.E4M3)
    for round_to in (None, torch.bfloat16):
        got = fk.cast_many(xs, scales, spec, round_to=round_to)
        for i, (x, q) in enumerate(zip(xs, got)):
            want = fk.cast(x, scales[i:i + 1, :1], spec, round_to=round_to)[0]
            assert q.shape == x.shape and torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="non-empty list"):
        fk.cast_many([], scales, spec)
    with pytest.raises(ValueError, match="mix dtypes"):
        fk.cast_many([xs[0], xs[1].bfloat16()], scales[:2], spec)
    with pytest.raises(ValueError, match="TensorWise"):
        fk.cast_many(xs, scales, f8.CastSpec(granularity=f8.AxisWise(-1)))
    with pytest.raises(ValueError, match=r"expected float32 \[3, s\]"):
        fk.cast_many(xs, scales[:2], spec)
    # out=: the casts written into that buffer, in order, bitwise; its views returned
    out = torch.full((8 * 16 + 3 * 32,), float("nan")).to(f8.E4M3)
    into = fk.cast_many(xs, scales, spec, out=out)
    assert into[0].data_ptr() == out.data_ptr() and into[1].data_ptr() == out[8 * 16:].data_ptr()
    for a, b in zip(into, fk.cast_many(xs, scales, spec)):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match=r"out is \(\(224,\), torch.float8_e5m2.*expected a contiguous 1-D "
                                         r"torch.float8_e4m3fn tensor of 224 elements"):
        fk.cast_many(xs, scales, spec, out=out.view(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"of 224 elements"):
        fk.cast_many(xs, scales, spec, out=out[1:])


def test_rows_cols_are_the_row_and_column_casts_and_check_their_arguments():
    """The reference path of ``amax_rows_cols`` / ``cast_rows_cols`` (the GPU kernels are checked
    against it below): bitwise the row-wise and column-wise amax and casts of the oracle, an fp32
    tensor rounded to bf16 as ``x.to(torch.bfloat16)``; wrong arguments raise with the fix."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 53, generator=g) * torch.logspace(-3, 3, 53)  # columns of very different size
    x[4, 7], x[9, 3], x[20] = float("nan"), -float("inf"), 0.0
    rows, cols = fk.amax_rows_cols(x)
    assert_bitwise(rows, fk.amax(x, ROW), "rows")
    assert_bitwise(cols, fk.amax(x, f8.AxisWise(0)), "cols")
    out = torch.zeros(37 + 53 + 5)[5:]  # a slice of a larger buffer: rows first, then columns
    r2, c2 = fk.amax_rows_cols(x, out=out)
    assert r2.data_ptr() == out.data_ptr() and c2.data_ptr() == out[37:].data_ptr()
    assert_bitwise(r2, rows, "rows in out")
    assert_bitwise(c2, cols, "cols in out")
    row_spec, col_spec = f8.CastSpec(f8.E4M3, ROW, True), f8.CastSpec(f8.E5M2, f8.AxisWise(0))
    x = torch.randn(37, 53, generator=g) * torch.logspace(-3, 3, 53)
    for round_to in (None, torch.bfloat16):
        hp = x if round_to is None else x.to(round_to)
        want_r, want_c = oracle(hp, row_spec), oracle(hp, col_spec)
        got_r, got_c = fk.cast_rows_cols(x, want_r[1], row_spec, want_c[1], col_spec, round_to=round_to)
        assert_bitwise(got_r, want_r[0], "row cast")
        assert_bitwise(got_c, want_c[0], "column cast")
    s_r, s_c = torch.ones(37, 1), torch.ones(1, 53)
    with pytest.raises(ValueError, match=r"out is \(\(90,\), torch.float64.*expected contiguous float32 zeros"):
        fk.amax_rows_cols(x, out=torch.zeros(90, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"col_spec=.*AxisWise\(axis=-1\).*expected a CastSpec with AxisWise\(0\)"):
        fk.cast_rows_cols(x, s_r, row_spec, s_c, row_spec)
    with pytest.raises(ValueError, match=r"col_scale is \(\(53, 1\).*expected float32 of shape \(1, 53\)"):
        fk.cast_rows_cols(x, s_r, row_spec, s_c.t(), col_spec)
    with pytest.raises(ValueError, match=r"round_to=torch.float16"):
        fk.cast_rows_cols(x, s_r, row_spec, s_c, col_spec, round_to=torch.float16)


# --------------------------------------------------------------------------------------------
# GPU: the kernels inside compiled code (one buffer read in place, amaxes fused into their
# producers) and cast_many, the one-launch cast of every weight.


# A launch of an fp8func kernel in inductor's code, and the buffer its x argument reads.
_KERNEL_LAUNCH = re.compile(
    r"\b(?:_amax_flat|_amax_2d|_cast|_quant|_quant_t)_kernel\w*\.run\(\s*(?:reinterpret_tensor\()?(\w+)")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("dim", [512, 1040], ids=["dim512", "dim1040-padded"])
def test_compiled_casts_read_an_intermediate_in_place(recipe, dim, monkeypatch):
    """q, k and v reading a tensor made inside the compiled graph (a norm's output in a decoder
    layer): with the kernels' anchor (``kernels._triton_device.anchor``) the forward's cast
    kernels all read the one buffer the tensor is written to; without it inductor hands each
    kernel a copy of its own. Outputs and gradients are bitwise the same either way. dim 1040:
    inductor pads rows longer than 1024 elements to a multiple of 64, so the kernels read copies
    laid out as traced, with the anchor too."""
    from torch import nn
    from torch._inductor.utils import run_and_get_code

    from fp8func.kernels import _triton_amax, _triton_block, _triton_cast

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(dim, 512, bias=False) for _ in range(3))

        def forward(self, x):
            h = x * 1.5
            return self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)

    def step(fn, xx):
        y = fn(xx)
        y.sum().backward()
        return y.detach()

    torch.manual_seed(0)
    base = QKV().cuda().bfloat16()
    x = torch.randn(4, 256, dim, device="cuda").bfloat16()
    runs, read = {}, {}
    for anchored in (True, False):
        if not anchored:
            for module in (_triton_amax, _triton_block, _triton_cast):
                monkeypatch.setattr(module, "anchor", lambda t: t)
        torch._dynamo.reset()
        model = f8.convert(copy.deepcopy(base), recipe, fsdp_fp8_all_gather=False)
        fn = torch.compile(model, fullgraph=True)
        xx = x.clone().requires_grad_()
        y, code = run_and_get_code(step, fn, xx)
        runs[anchored] = [y, xx.grad, *(p.grad for p in model.parameters())]
        launches = _KERNEL_LAUNCH.findall(code[0])
        assert launches, code[0]
        read[anchored] = {name for name in launches if not name.startswith("primals")}  # weights: graph inputs
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))
    if dim == 512:
        assert len(read[True]) == 1 < len(read[False]), read


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["randn", "nan", "-inf", "zeros", "fp32"])
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 4096), (37, 256), (1, 64)], ids=str)
def test_compiled_fused_amax_is_bitwise_the_amax_kernel(kind, shape):
    """``fuse_amax``: a tensorwise amax that inductor computes inside the kernel producing x (here
    x * 1.5, computed in fp32 and stored as bf16) gives the amax kernel's scale, bit for bit: the
    maximum is taken over the stored values' bits, NaN canonical, so no unrounded product and no
    NaN payload can change it."""
    from fp8func import kernels

    spec = f8.CastSpec(f8.E4M3, f8.TensorWise())
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(shape, device="cuda", generator=g, dtype=torch.float32 if kind == "fp32" else torch.bfloat16) * 3
    if kind == "nan":
        a[shape[0] // 2, -1] = float("nan")
    elif kind == "-inf":
        a[-1, 0] = float("-inf")
    elif kind == "zeros":
        a.zero_()
    eager = kernels.quantize(a * 1.5, spec, transpose=True)
    torch._dynamo.reset()
    fused = torch.compile(lambda t: kernels.quantize(t * 1.5, spec, transpose=True, fuse_amax=True), fullgraph=True)(a)
    for q, r in zip(eager, fused, strict=True):
        assert torch.equal(q.scale.view(torch.int32), r.scale.view(torch.int32))
        assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))


@pytest.mark.gpu
def test_compiled_fused_amax_of_up_to_fold_rows_takes_no_launch_of_its_own():
    """Up to ``FOLD_ROWS`` rows the cast kernel reduces the fused row maxima itself; one row more
    and inductor reduces them first, in a launch of its own. Both give the eager kernels' bits."""
    from torch._inductor.utils import run_and_get_code

    from fp8func import kernels
    from fp8func.kernels._triton_quant import FOLD_ROWS

    spec = f8.CastSpec(f8.E4M3, f8.TensorWise())
    g = torch.Generator(device="cuda").manual_seed(0)
    launches = {}
    for rows in (FOLD_ROWS, FOLD_ROWS + 1):
        a = torch.randn(rows, 1024, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        a[rows // 3, 5] = float("nan") if rows > FOLD_ROWS else 1e4
        eager = kernels.quantize(a * 1.5, spec, transpose=True)
        torch._dynamo.reset()
        fn = torch.compile(lambda t: kernels.quantize(t * 1.5, spec, transpose=True, fuse_amax=True), fullgraph=True)
        fused, code = run_and_get_code(fn, a)
        launches[rows] = re.findall(r"\b(\w+)\.run\(", code[0])
        for q, r in zip(eager, fused, strict=True):
            assert torch.equal(q.scale.view(torch.int32), r.scale.view(torch.int32))
            assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))
    torch._dynamo.reset()
    assert len(launches[FOLD_ROWS]) + 1 == len(launches[FOLD_ROWS + 1]), launches
    assert sum(n.startswith("_cast_kernel") for n in launches[FOLD_ROWS]) == 1, launches


@pytest.mark.gpu
def test_compiled_block_with_fused_amaxes_is_bitwise_the_amax_kernels(monkeypatch):
    """A compiled SiLU-mul -> linear -> RMSNorm -> linear block, forward and backward: with the
    activations' and gradients' amaxes fused into their producers (the default under
    torch.compile) the outputs and gradients are bitwise those of the amax kernels, and the
    forward launches the amax kernel for the weights alone."""
    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code

    from fp8func.kernels import _triton_quant

    def block(gate, up, w1, w2):
        y = f8.linear(F.silu(gate) * up, w1, recipe="tensorwise")
        return f8.linear(F.rms_norm(y, (y.shape[-1],)), w2, recipe="tensorwise")

    g = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(2, 1000, 2048, device="cuda", generator=g).bfloat16() for _ in "gu")
    w1 = (torch.randn(1024, 2048, device="cuda", generator=g) / 2048**0.5).bfloat16()
    w2 = (torch.randn(512, 1024, device="cuda", generator=g) / 1024**0.5).bfloat16()
    runs, amax_launches = {}, {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(_triton_quant, "_amax_in_graph", lambda t: None)
        torch._dynamo.reset()
        fn = torch.compile(block, fullgraph=True)
        leaves = [t.clone().requires_grad_() for t in (gate, up, w1, w2)]
        y, code = run_and_get_code(fn, *leaves)
        y.float().square().sum().backward()
        runs[fused] = [y, *(t.grad for t in leaves)]
        amax_launches[fused] = len(re.findall(r"\b_amax_flat_kernel\w*\.run\(", code[0]))
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))
    assert amax_launches == {True: 2, False: 4}, amax_launches


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [f8.E4M3, f8.E5M2])
@pytest.mark.parametrize("src", ["fp32->bf16", "bf16", "fp32"])
def test_cast_many_is_bitwise_the_reference_and_the_one_tensor_kernel(dtype, src):
    """precompute_scales' one-launch cast of every weight: bitwise the PyTorch twin and the one-tensor
    cast kernel, per tensor (special values, empty and odd-sized tensors, padded scale rows)."""
    import fp8func.kernels as fk

    from .test_fsdp import _special_shards

    xs = [t.float().reshape(1, -1) if t.ndim == 1 else t.float() for t in _special_shards("cuda")]
    xs += [torch.randn(4096 + 3, 517, device="cuda") * 7]
    if src == "bf16":
        xs = [x.bfloat16() for x in xs]
    round_to = torch.bfloat16 if src == "fp32->bf16" else None
    scales = torch.rand(len(xs), 4, device="cuda") * 0.1 + 1e-3
    spec = f8.CastSpec(dtype)
    fast = fk.cast_many(xs, scales, spec, round_to=round_to, impl="triton")
    slow = fk.cast_many(xs, scales, spec, round_to=round_to, impl="reference")
    out = torch.empty(sum(x.numel() for x in xs), dtype=dtype, device="cuda")
    into = fk.cast_many(xs, scales, spec, round_to=round_to, out=out, impl="triton")  # precompute's kept buffer
    for i, (x, a, b, c) in enumerate(zip(xs, fast, slow, into)):
        one = fk.cast(x, scales[i:i + 1, :1], spec, round_to=round_to, impl="triton")[0]
        assert a.shape == x.shape and a.dtype == dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
        assert torch.equal(a.view(torch.uint8), one.view(torch.uint8)), i
        assert torch.equal(c.view(torch.uint8), a.view(torch.uint8)), i
    assert into[0].data_ptr() == out.data_ptr()


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("src", ["fp32->bf16", "bf16", "fp32"])
def test_rows_cols_kernels_are_bitwise_the_reference(src):
    """precompute_scales' row-wise passes (a row-wise weight's row and column amaxes from one read,
    both casts from another): bitwise the PyTorch twins, on special values, bf16 rounding ties,
    ragged and empty shapes, saturating and extreme scales, E4M3 rows with E4M3 / E5M2 columns."""
    round_to = torch.bfloat16 if src == "fp32->bf16" else None
    dtype = torch.bfloat16 if src == "bf16" else torch.float32
    for i, shape in enumerate([(1, 1), (37, 53), (256, 4096), (1024, 14336), (4097, 515), (0, 64)]):
        for kind in ("randn", "specials", "zeros"):
            x = _gpu_input(shape, dtype, kind, i) if shape[0] else torch.empty(shape, device="cuda", dtype=dtype)
            if round_to is not None:
                x.view(-1)[::7] = x.view(-1)[::7].bfloat16().float() * (1 + 2.0 ** -8)  # bf16 rounding ties
            out = torch.zeros(sum(shape) + 3, device="cuda")[3:]
            got = fk.amax_rows_cols(x, out=out, impl="triton")
            want = fk.amax_rows_cols(x, impl="reference")
            for a, b, name in zip(got, want, ("rows", "cols")):
                assert_bitwise(a, b, f"{shape} {kind} amax {name}")
            hp = x if round_to is None else x.to(round_to)
            for fp8_t in (f8.E4M3, f8.E5M2):
                row_spec, col_spec = f8.CastSpec(f8.E4M3, ROW, True), f8.CastSpec(fp8_t, f8.AxisWise(0), True)
                s_r = (fk.quantize(hp, row_spec, impl="reference")[0].scale if shape[0]
                       else torch.ones(0, 1, device="cuda"))
                s_c = f8.compute_scale(fk.amax(hp, f8.AxisWise(0), impl="reference"), fp8_t, True)
                for scales in ("own", "saturating", "extreme"):
                    sr, sc = s_r, s_c
                    if scales == "saturating":
                        sr, sc = sr / 64, sc / 64
                    elif scales == "extreme":  # huge (reciprocal subnormal), tiny (x * recip overflows), inf, NaN
                        pick = torch.tensor([2.0**127, 3.0e38, 1e-30, float("inf"), float("nan"), 1.5], device="cuda")
                        sr = pick[torch.arange(sr.numel(), device="cuda") % 6].reshape(sr.shape)
                        sc = pick[torch.arange(sc.numel(), device="cuda") % 5].reshape(sc.shape)
                    got = fk.cast_rows_cols(x, sr, row_spec, sc, col_spec, round_to=round_to, impl="triton")
                    want = fk.cast_rows_cols(x, sr, row_spec, sc, col_spec, round_to=round_to, impl="reference")
                    for a, b, name in zip(got, want, ("rows", "cols")):
                        assert_bitwise(a, b, f"{shape} {kind} {fp8_t} {scales} cast {name}")


def test_transpose_is_the_contiguous_transpose_and_checks_its_argument():
    """``kernels.transpose`` is ``x.t().contiguous()`` bit for bit (the twin; the GPU kernel below);
    anything but a contiguous 2-D tensor of 1-, 2- or 4-byte elements raises with the fix."""
    x = torch.randint(0, 256, (37, 53), dtype=torch.uint8).view(f8.E4M3)
    y = fk.transpose(x)
    assert y.dtype == x.dtype and y.is_contiguous()
    assert torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8))
    for bad in (x.t(), x.view(-1), torch.zeros(2, 2, dtype=torch.float64), "x"):
        with pytest.raises(ValueError, match="transpose: x is .*expected a contiguous 2-D tensor"):
            fk.transpose(bad)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [f8.E4M3, f8.E5M2, torch.bfloat16, torch.float32])
def test_transpose_kernel_is_bitwise_the_reference(dtype):
    """The tiled transpose moves every bit as torch's copy does (NaN payloads included), ragged,
    one-row, one-column and empty shapes, and the row-wise w_t shapes of an 8B model's shards."""
    for shape in [(1, 1), (1, 4097), (4097, 1), (37, 53), (1024, 14336), (3584, 4096), (0, 64)]:
        bits = torch.randint(-2**31, 2**31 - 1, shape, device="cuda", dtype=torch.int64)
        x = bits.to(torch.int32).view(torch.uint8)[:, : shape[1] * torch.empty((), dtype=dtype).element_size()]
        x = x.contiguous().view(dtype)
        got = fk.transpose(x, impl="triton")
        want = fk.transpose(x, impl="reference")
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
        assert got.shape == want.shape and got.is_contiguous(), shape
        assert torch.equal(got.view(ints), want.view(ints)), (shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_selective_checkpoint_policy_keeps_the_input_casts_out_of_the_backward(recipe):
    """A compiled block under op-level selective checkpointing: with
    ``fp8func.nn.selective_checkpoint_policy`` the backward launches no cast of the recomputed
    inputs (fewer cast kernels than with the plain list), and outputs and gradients are bitwise
    those of the list and of no checkpointing."""
    import functools

    from torch._inductor.utils import run_and_get_code
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import fp8func.kernels._triton_quant  # noqa: F401  (registers the op the policy reads)

    args = torch.ops.fp8func.kernels_quantize.default._schema.arguments
    assert args[6].name == "fuse_amax"  # the argument selective_checkpoint_policy reads

    def step(fn, x):
        y = fn(x)
        y.float().square().sum().backward()
        return y.detach()

    torch.manual_seed(0)
    base = f8.convert(ResidualMlp(512, 1024).cuda().bfloat16(), recipe, fsdp_fp8_all_gather=False)
    x0 = torch.randn(2048, 512, device="cuda").bfloat16()
    save = [torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default]
    results, casts = {}, {}
    for name, policy in (("none", None), ("list", save), ("policy", f8.nn.selective_checkpoint_policy(save))):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = model if policy is None else checkpoint_wrapper(
            model, preserve_rng_state=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        x = x0.clone().requires_grad_()
        y, code = run_and_get_code(step, torch.compile(run, fullgraph=True), x)
        results[name] = [y, x.grad, *(p.grad for p in model.parameters())]
        casts[name] = len(re.findall(r"\b_(?:cast|quant)\w*_kernel\w*\.run\(", code[-1]))  # the backward's
    torch._dynamo.reset()
    for name in ("list", "policy"):
        assert all(torch.equal(a, b) for a, b in zip(results["none"], results[name], strict=True)), name
    assert casts["policy"] < casts["list"], casts
