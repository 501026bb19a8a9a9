"""fp8func._plan: what each named recipe plans per GEMM, how a plan checks itself, what ``operand``,
``transposed`` and ``untileable`` say, and mixed plans run by ``linear`` as their GEMMs written out."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8func as f8
from fp8func import _gemm
from fp8func._plan import GemmPlan, LinearPlan, OperandCasts, operand, transposed, untileable
from fp8func._scaling import GEMMS, KERNEL_MODES, NAMED_RECIPES, PATHS

E4, E5 = f8.E4M3, f8.E5M2
TW, TW5 = f8.CastSpec(E4), f8.CastSpec(E5)
ROW = f8.CastSpec(E4, f8.AxisWise(-1), True)
B1, B128 = f8.CastSpec(E4, f8.BlockWise((1, 128))), f8.CastSpec(E4, f8.BlockWise((128, 128)))
MX = f8.CastSpec(E4, f8.MX(32))

# Per named recipe: the (a, b) casts of the output, grad_input and grad_weight GEMMs, each written
# on its operand laid out [other, contraction]; then whether the backward reuses the forward's
# cast of x, w and dy (the second cast is the first seen transposed).
NAMED = {
    "tensorwise": (((TW, TW), (TW5, TW), (TW5, TW)), (True, True, True)),
    "rowwise": (((ROW, ROW), (ROW, ROW), (ROW, ROW)), (False, False, False)),
    "rowwise_with_gw_hp": (((ROW, ROW), (ROW, f8.CastSpec(E4, f8.TensorWise(), True)), (None, None)),
                           (False, False, False)),
    "blockwise": (((B1, B128), (B1, B128), (B1, B1)), (False, True, False)),
    "mxfp8": (((MX, MX), (MX, MX), (MX, MX)), (False, False, False)),
    "delayed": (((TW, TW), (TW5, TW), (TW5, TW)), (True, True, True)),
}

# The module docstring's plan: row-wise forward and grad_input, a tensorwise E5M2 x E4M3 grad_weight.
ROW_FWD = LinearPlan(output=GemmPlan(ROW, ROW), grad_input=GemmPlan(ROW, ROW),
                     grad_weight=GemmPlan(TW5, TW), name="row-fwd")


def test_every_named_recipe_is_tabled_here():
    assert set(NAMED) == set(NAMED_RECIPES)


@pytest.mark.parametrize("name", list(NAMED))
def test_named_recipes_plan_these_casts(name):
    casts, reuses = NAMED[name]
    p = f8.plan(name)
    assert isinstance(p, LinearPlan) and p.name == name
    assert [(g.a, g.b) for g in (p.output, p.grad_input, p.grad_weight)] == list(casts)
    assert [g.hp for g in (p.output, p.grad_input, p.grad_weight)] == [False, False, name == "rowwise_with_gw_hp"]
    assert all(not g.fast_accum and g.path == "auto" for g in (p.output, p.grad_input, p.grad_weight))
    assert p.kernels == "auto"
    assert p.delayed == (f8.DelayedScaling() if name == "delayed" else None)
    assert tuple(operand(p, role).reuses for role in ("x", "w", "dy")) == reuses
    assert f8.plan(f8.Recipe.from_name(name)) == p
    assert f8.plan(p) is p  # a LinearPlan is the plan


def test_operand_names_each_tensors_two_casts():
    """x: the output GEMM's a and grad_weight's b; w: output's b and grad_input's b; dy: grad_input's
    a and grad_weight's a."""
    assert operand(ROW_FWD, "x") == OperandCasts(ROW, TW, False)
    assert operand(ROW_FWD, "w") == OperandCasts(ROW, ROW, False)  # w.T's rows are w's columns
    assert operand(ROW_FWD, "dy") == OperandCasts(ROW, TW5, False)
    hp = f8.plan("rowwise_with_gw_hp")
    assert operand(hp, "x") == OperandCasts(ROW, None, False)  # grad_weight in high precision
    assert operand(hp, "dy") == OperandCasts(ROW, None, False)
    with pytest.raises(ValueError, match=r"operand\(role='b'\): expected 'x', 'w' or 'dy'"):
        operand(ROW_FWD, "b")


@given(name=st.sampled_from(sorted(NAMED)), fast=st.lists(st.sampled_from(GEMMS), unique=True).map(tuple),
       path=st.sampled_from(PATHS), kernels=st.sampled_from(KERNEL_MODES))
def test_recipe_overrides_reach_each_gemm(name, fast, path, kernels):
    """``Recipe.fast_accum`` names GEMMs: those, and only those, plan fast accumulation; ``path``
    goes to all three GEMMs and ``kernels`` to the plan; the casts stay the named recipe's."""
    p = f8.plan(f8.Recipe.from_name(name, fast_accum=fast, path=path, kernels=kernels))
    base = f8.plan(name)
    for gemm in GEMMS:
        g, b = getattr(p, gemm), getattr(base, gemm)
        assert (g.a, g.b, g.fast_accum, g.path) == (b.a, b.b, gemm in fast, path), gemm
    assert (p.kernels, p.delayed, p.name) == (kernels, base.delayed, name)


def test_fast_accum_of_a_plan_reaches_only_its_gemms_kernels(monkeypatch):
    """On the hardware path (CPU ``torch._scaled_mm`` here) each GEMM's kernel gets its own plan's
    ``fast_accum``: forward, then grad_input, then grad_weight."""
    seen = []
    orig = _gemm._scaled_mm
    monkeypatch.setattr(_gemm, "_scaled_mm", lambda kind, a, b, out, fast=False: seen.append(fast) or
                        orig(kind, a, b, out, fast))
    recipe = f8.Recipe.from_name("tensorwise", path="hardware", fast_accum=("output", "grad_weight"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).requires_grad_()
    w = torch.randn(48, 64, generator=g).requires_grad_()
    f8.linear(x, w, recipe=recipe).backward(torch.randn(32, 48, generator=g))
    assert seen == [True, False, True]


def test_gemm_plan_checks_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"GemmPlan\(a=CastSpec\(.*\), b=None\): give both casts \(an FP8 GEMM\) "
                                         r"or neither \(a high-precision GEMM\)"):
        GemmPlan(TW, None)
    with pytest.raises(ValueError, match=r"GemmPlan\(a=None, b=CastSpec\(.*\)\): give both casts"):
        GemmPlan(None, TW)
    with pytest.raises(TypeError, match=r"GemmPlan\(b='rowwise'\): expected a CastSpec or None"):
        GemmPlan(TW, "rowwise")
    with pytest.raises(TypeError, match=r"GemmPlan\(fast_accum=1\): expected True or False"):
        GemmPlan(TW, TW, fast_accum=1)
    with pytest.raises(ValueError, match=r"GemmPlan\(path='gpu'\): expected one of \('auto', 'hardware', 'emulated'\)"):
        GemmPlan(TW, TW, path="gpu")
    assert GemmPlan(None, None).hp and not GemmPlan(TW, TW5).hp


def test_linear_plan_checks_name_the_value_and_the_fix():
    fp8, hp = GemmPlan(TW, TW), GemmPlan(None, None)
    with pytest.raises(TypeError, match=r"LinearPlan\(grad_input=\(.*\)\): expected a GemmPlan"):
        LinearPlan(fp8, (TW, TW), fp8)
    with pytest.raises(ValueError, match=r"the output GEMM is what makes a layer FP8; use "
                                         r"torch.nn.functional.linear for a high-precision layer"):
        LinearPlan(hp, fp8, fp8)
    with pytest.raises(ValueError, match=r"LinearPlan\(kernels='triton'\): expected one of "
                                         r"\('auto', 'off', 'reference'\)"):
        LinearPlan(fp8, fp8, fp8, kernels="triton")
    with pytest.raises(TypeError, match=r"LinearPlan\(name=3\): expected a str"):
        LinearPlan(fp8, fp8, fp8, name=3)
    with pytest.raises(TypeError, match=r"LinearPlan\(delayed=16\): expected a DelayedScaling or None"):
        LinearPlan(fp8, fp8, fp8, delayed=16)
    assert LinearPlan(fp8, hp, hp).grad_input.hp  # only the output GEMM must be FP8


@pytest.mark.parametrize("gemms", [
    (GemmPlan(ROW, ROW), GemmPlan(ROW, ROW), GemmPlan(ROW, ROW)),  # not tensorwise
    (GemmPlan(TW, TW), GemmPlan(TW5, TW), GemmPlan(None, None)),  # a high-precision GEMM
    (GemmPlan(TW, TW), GemmPlan(TW5, TW), GemmPlan(TW5, TW5)),  # x cast E4M3 forward, E5M2 for grad_weight
    (GemmPlan(TW, TW), GemmPlan(TW5, f8.CastSpec(E4, power_of_2=True)), GemmPlan(TW5, TW)),  # w's two casts differ
], ids=["rowwise", "gw-hp", "x-two-dtypes", "w-two-roundings"])
def test_delayed_plans_keep_one_tensorwise_cast_per_tensor(gemms):
    with pytest.raises(ValueError, match=r"LinearPlan 'mine' with delayed scaling: delayed scaling keeps one scale "
                                         r"per tensor.*Use Recipe.from_name\('delayed'\) or dynamic scaling"):
        LinearPlan(*gemms, delayed=f8.DelayedScaling(), name="mine")
    ok = LinearPlan(GemmPlan(TW, TW), GemmPlan(TW5, TW), GemmPlan(TW5, TW), delayed=f8.DelayedScaling(4))
    assert ok.delayed.history_len == 4 and all(operand(ok, role).reuses for role in ("x", "w", "dy"))


def test_plan_of_anything_else_names_what_it_takes():
    with pytest.raises(TypeError, match=r"recipe=3; expected a Recipe, a LinearPlan or a recipe name such as "
                                        r"'tensorwise'"):
        f8.plan(3)
    with pytest.raises(ValueError, match=r"Recipe.from_name\('rowise'\): unknown recipe \(did you mean 'rowwise'\?\)"):
        f8.plan("rowise")


# --------------------------------------------------------------------------------------------
# transposed / reuse: the same groups seen from the other side give the same bits.

GRANULARITIES = [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.AxisWise(1), f8.AxisWise(-2),
                 f8.BlockWise((1, 128)), f8.BlockWise((128,)), f8.BlockWise((128, 1)), f8.BlockWise((128, 128)),
                 f8.MX(32), f8.MX(32, 0)]
specs = st.builds(f8.CastSpec, st.sampled_from([E4, E5]), st.sampled_from(GRANULARITIES), st.booleans())
sides = st.integers(1, 2).map(lambda g: 128 * g)  # every granularity above tiles these


def _bits(q: f8.Fp8Tensor):
    return q.data.contiguous().view(torch.uint8), f8.dequantize(q, torch.float32)


@given(spec=specs, m=sides, k=sides, seed=st.integers(0, 2**16))
def test_transposed_spec_casts_the_transpose_to_the_same_bits(spec, m, k, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 4
    q, q_t = f8.quantize(x, spec).t(), f8.quantize(x.t(), transposed(spec))
    assert all(torch.equal(a, b) for a, b in zip(_bits(q), _bits(q_t)))
    # so a plan whose grad_weight casts x.T with transposed(x's forward cast) reuses that cast
    p = LinearPlan(GemmPlan(spec, TW), GemmPlan(TW5, TW), GemmPlan(TW5, transposed(spec)))
    assert operand(p, "x").reuses


@given(first=specs, data=st.data(), m=sides, k=sides, seed=st.integers(0, 2**16))
def test_a_reused_cast_is_the_second_cast_bitwise(first, data, m, k, seed):
    """``operand(...).reuses``, which lets the backward read the forward's cast of x instead of
    casting x.T again, holds only where the second cast gives the forward cast's bits."""
    # the second cast: any, the first seen transposed, or one with the first's dtype and rounding
    second = data.draw(st.one_of(specs, st.just(transposed(first)),
                                 st.sampled_from(GRANULARITIES).map(first.with_granularity)))
    p = LinearPlan(GemmPlan(first, TW), GemmPlan(TW5, TW), GemmPlan(TW5, second))
    casts = operand(p, "x")
    assert (casts.first, casts.second) == (first, second)
    if casts.reuses:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 4
        fwd, bwd = f8.quantize(x, first).t(), f8.quantize(x.t(), second)  # both [K, M], along M
        assert all(torch.equal(a, b) for a, b in zip(_bits(fwd), _bits(bwd)))


# --------------------------------------------------------------------------------------------
# untileable


def test_untileable_names_the_gemm_the_operand_and_the_fix():
    bw = f8.plan("blockwise")
    why = untileable(bw, 4, 64, 32)
    assert why.startswith("the output GEMM's input x cast cannot tile its operand (4, 64): BlockWise(block=(1, 128)) "
                          "does not divide a tensor of shape (4, 64)"), why
    assert "keep this layer out of FP8 (convert(..., filter=...))" in why
    assert untileable(bw, 64, 256, 256).startswith("the grad_weight GEMM's grad_output dy.T cast cannot tile its "
                                                   "operand (256, 64)")
    assert untileable(bw, None, 256, 256) == ""  # tokens not known yet: only the dims that do not depend on them
    assert untileable(bw, None, 256, 64).startswith("the output GEMM's weight w cast cannot tile its operand (64, 256)")
    assert untileable(f8.plan("mxfp8"), 48, 64, 256).startswith("the grad_weight GEMM's grad_output dy.T cast")
    assert untileable(f8.plan("rowwise"), 3, 5, 7) == untileable(f8.plan("tensorwise"), 1, 1, 1) == ""
    assert untileable(f8.plan("rowwise_with_gw_hp"), 3, 5, 7) == ""


@given(name=st.sampled_from(sorted(NAMED)), k=st.integers(1, 4).map(lambda g: 32 * g),
       n=st.integers(1, 4).map(lambda g: 32 * g), j=st.integers(1, 3))
def test_untileable_without_tokens_is_untileable_at_any_whole_block_of_tokens(name, k, n, j):
    p = f8.plan(name)
    assert (untileable(p, None, k, n) == "") == (untileable(p, 128 * j, k, n) == "")


@given(name=st.sampled_from(sorted(set(NAMED) - {"delayed"})), m=st.integers(1, 8).map(lambda g: 32 * g),
       k=st.integers(1, 4).map(lambda g: 32 * g), n=st.integers(1, 4).map(lambda g: 32 * g))
def test_untileable_says_whether_linear_runs(name, m, k, n):
    """Where ``untileable`` finds nothing, linear's forward and backward cast every operand; where it
    finds a cast that cannot tile, linear raises with its words before any work."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).requires_grad_()
    why = untileable(f8.plan(name), m, k, n)
    if why:
        with pytest.raises(ValueError, match=re.escape(why)):
            f8.linear(x, w, recipe=name)
    else:
        f8.linear(x, w, recipe=name).backward(torch.randn(m, n, generator=g))
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


# --------------------------------------------------------------------------------------------
# mixed plans through linear: the three GEMMs written out


def _explicit(p: LinearPlan, x, w, dy):
    """y = x @ w.T, dx = dy @ w, dw = dy.T @ x with each operand cast on its [other, contraction]
    layout as the plan says (``gemm(a, b.T)`` of a [P, C] and b [Q, C]), or in high precision."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])

    def mm(g: GemmPlan, a, b):
        if g.hp:
            return a @ b.t()
        return f8.gemm(f8.quantize(a, g.a), f8.quantize(b, g.b).t(), torch.float32)

    y = mm(p.output, x2, w)
    dx = mm(p.grad_input, dy2, w.t())
    dw = mm(p.grad_weight, dy2.t(), x2.t())
    return y.reshape(*x.shape[:-1], w.shape[0]), dx.reshape(x.shape), dw


def _linear(p, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = f8.linear(x, w, recipe=p)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _data(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, m // 2, k, generator=g), torch.randn(n, k, generator=g) / k**0.5,
            torch.randn(2, m // 2, n, generator=g))


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_mixed_plan_runs_as_its_gemms_written_out(kernels):
    x, w, dy = _data(128, 256, 128, 0)
    p = LinearPlan(ROW_FWD.output, ROW_FWD.grad_input, ROW_FWD.grad_weight, kernels=kernels, name="row-fwd")
    got, want = _linear(p, x, w, dy), _explicit(p, x, w, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert torch.equal(a, b), name
    # and not a named recipe's numbers: the grad_weight GEMM is tensorwise here
    assert not torch.equal(got[2], _linear(f8.plan("rowwise"), x, w, dy)[2])


gemm_plans = st.builds(GemmPlan, specs, specs)


@given(output=gemm_plans, grad_input=st.one_of(st.just(GemmPlan(None, None)), gemm_plans),
       grad_weight=st.one_of(st.just(GemmPlan(None, None)), gemm_plans), kernels=st.sampled_from(KERNEL_MODES),
       k=sides, n=sides, seed=st.integers(0, 2**16))
def test_any_plan_runs_as_its_gemms_written_out(output, grad_input, grad_weight, kernels, k, n, seed):
    """Any mix of casts per GEMM (reused or cast again in the backward, through the kernels' twins
    or not, high-precision backward GEMMs): linear's output and gradients are the explicit GEMMs',
    bitwise."""
    p = LinearPlan(output, grad_input, grad_weight, kernels=kernels)
    x, w, dy = _data(128, k, n, seed)
    for name, a, b in zip(("y", "dx", "dw"), _linear(p, x, w, dy), _explicit(p, x, w, dy), strict=True):
        assert torch.equal(a, b), name
