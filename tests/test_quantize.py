"""Properties of the pure scaling math: quantize / dequantize for every granularity."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8func as f8
from fp8func._formats import fp8_ulp

from .strategies import shapes_2d, shapes_nd, tensors

DTYPES = [f8.E4M3, f8.E5M2]


def granularities_for(shape):
    """Granularities that tile a 2-D ``shape`` whose dims are multiples of 4."""
    m, k = shape
    return [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.BlockWise((1, 4)),
            f8.BlockWise((2, 4)), f8.BlockWise((4, 4)), f8.MX(4), f8.MX(2, axis=0)]


specs = st.builds(
    lambda dtype, gi, p2: (dtype, gi, p2),
    st.sampled_from(DTYPES), st.integers(0, 7), st.booleans(),
)


def _spec(shape, drawn):
    dtype, gi, p2 = drawn
    return f8.CastSpec(dtype=dtype, granularity=granularities_for(shape)[gi], power_of_2=p2)


@given(x=tensors(shapes_2d(mult=(4, 4)), specials=True), drawn=specs)
def test_roundtrip_error_within_half_ulp(x, drawn):
    spec = _spec(tuple(x.shape), drawn)
    q = f8.quantize(x, spec)
    assert q.data.dtype == spec.dtype and q.scale.dtype == torch.float32
    assert q.scale.shape == f8.scale_shape(spec.granularity, tuple(x.shape))
    xf = x.float()
    x_hat = f8.dequantize(q, torch.float32)
    scale = f8.dequantize(f8.Fp8Tensor(torch.ones_like(q.data), q.scale, q.meta), torch.float32)
    v = xf / scale  # ideal scaled value, in the fp8 grid's units
    bound = 0.5 * fp8_ulp(v, spec.dtype) * scale
    # x * (1/scale) and data * scale are fp32 roundings: a few fp32 ulps of |x| on top.
    slack = xf.abs() * 2.0**-21 + scale * 2.0**-40
    assert torch.all((x_hat - xf).abs() <= bound + slack)
    assert torch.isfinite(x_hat).all()


@given(x=tensors(shapes_nd(1, 3)), dtype=st.sampled_from(DTYPES), shrink=st.integers(2, 20))
def test_saturates_never_inf(x, dtype, shrink):
    spec = f8.CastSpec(dtype=dtype)
    amax = x.float().abs().amax().clamp(min=1e-30)
    too_small = (amax / f8.fp8_max(dtype) / 2.0**shrink).reshape([1] * x.ndim)
    q = f8.quantize_with_scale(x, too_small, spec)
    data = q.data.float()
    assert torch.isfinite(data).all()
    assert data.abs().max() == f8.fp8_max(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [f8.TensorWise(), f8.AxisWise(0), f8.BlockWise((2, 2)), f8.MX(2)])
def test_all_zero_gives_finite_scale_and_zeros(dtype, g):
    x = torch.zeros(4, 6)
    q = f8.quantize(x, f8.CastSpec(dtype=dtype, granularity=g))
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert torch.equal(q.scale, torch.full_like(q.scale, f8.EPS) * (1.0 / f8.fp8_max(dtype))) or isinstance(g, f8.MX)
    assert (q.data.float() == 0).all()
    assert torch.equal(f8.dequantize(q), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_poisons_its_group_only(bad):
    x = torch.randn(4, 8)
    x[1, 3] = bad
    q = f8.quantize(x, f8.CastSpec(granularity=f8.AxisWise(-1)))
    x_hat = f8.dequantize(q)
    assert torch.isnan(x_hat[1]).all(), "the group holding a NaN/inf dequantizes to NaN"
    rows = [0, 2, 3]
    assert torch.isfinite(x_hat[rows]).all()
    assert torch.equal(x_hat[rows], f8.dequantize(f8.quantize(x[rows], q.spec)))


def test_nan_stays_nan_tensorwise():
    x = torch.randn(3, 5)
    x[0, 0] = float("nan")
    assert torch.isnan(f8.dequantize(f8.quantize(x, f8.CastSpec()))[0, 0])


def test_check_finite_raises_naming_count_and_index():
    x = torch.randn(3, 5)
    x[2, 1] = float("inf")
    x[0, 4] = float("nan")
    with pytest.raises(ValueError, match=r"has 2 non-finite value\(s\), first nan at index \(0, 4\)"):
        f8.quantize(x, f8.CastSpec(), check_finite=True)
    f8.quantize(torch.randn(3, 5), f8.CastSpec(), check_finite=True)  # finite: no error


@given(x=tensors(shapes_2d(mult=(2, 4)), log2_range=(-16, 16)), drawn=specs, k=st.integers(-12, 12))
def test_pow2_scales_commute_with_powers_of_two(x, drawn, k):
    dtype, gi, _ = drawn
    spec = f8.CastSpec(dtype=dtype, granularity=granularities_for(tuple(x.shape))[gi], power_of_2=True)
    q, qk = f8.quantize(x, spec), f8.quantize(x * 2.0**k, spec)
    assert torch.equal(q.data.view(torch.uint8), qk.data.view(torch.uint8))
    assert torch.equal(qk.scale, q.scale * 2.0**k)


@given(x=tensors(shapes_2d(mult=(1, 1), max_groups=9)), dtype=st.sampled_from(DTYPES), p2=st.booleans(),
       axis=st.sampled_from([0, 1, -1]))
def test_axiswise_is_tensorwise_per_slice(x, dtype, p2, axis):
    q = f8.quantize(x, f8.CastSpec(dtype, f8.AxisWise(axis), p2))
    tw = f8.CastSpec(dtype, f8.TensorWise(), p2)
    other = 1 - (axis % 2)
    for i in range(x.shape[other]):
        qi = f8.quantize(x.select(other, i), tw)
        assert torch.equal(q.data.select(other, i).view(torch.uint8), qi.data.view(torch.uint8))
        assert torch.equal(q.scale.select(other, i).reshape(()), qi.scale.reshape(()))


@given(x=tensors(shapes_2d(mult=(4, 8), max_groups=4)), dtype=st.sampled_from(DTYPES), p2=st.booleans(),
       block=st.sampled_from([(1, 8), (4, 8), (2, 4), (4, 4), (4, 1)]))
def test_blockwise_is_tensorwise_per_block(x, dtype, p2, block):
    q = f8.quantize(x, f8.CastSpec(dtype, f8.BlockWise(block), p2))
    tw = f8.CastSpec(dtype, f8.TensorWise(), p2)
    bm, bk = block
    for i in range(x.shape[0] // bm):
        for j in range(x.shape[1] // bk):
            blk = (slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk))
            qb = f8.quantize(x[blk], tw)
            assert torch.equal(q.data[blk].view(torch.uint8), qb.data.view(torch.uint8))
            assert torch.equal(q.scale[i, j], qb.scale.reshape(()))


@given(x=tensors(shapes_2d(mult=(1, 32), max_groups=3), specials=True), dtype=st.sampled_from(DTYPES))
def test_mx_scales_are_powers_of_two_and_e8m0(x, dtype):
    q = f8.quantize(x, f8.CastSpec(dtype, f8.MX(32)))
    assert q.scale.shape == (x.shape[0], x.shape[1] // 32)
    mant, _ = torch.frexp(q.scale)
    assert torch.all(mant == 0.5), "every MX scale is an exact power of two"
    e8 = f8.to_e8m0(q.scale)
    assert e8.dtype == f8.E8M0
    assert torch.equal(e8.float(), q.scale)
    # The block max never saturates: scale is rounded *up*.
    assert torch.all(q.data.float().abs() <= f8.fp8_max(dtype))


@given(x=tensors(shapes_nd(1, 4, 7)), dtype=st.sampled_from(DTYPES))
def test_nd_tensors_and_leading_dims(x, dtype):
    spec = f8.CastSpec(dtype, f8.AxisWise(-1))
    q = f8.quantize(x, spec)
    q2 = f8.quantize(x.reshape(-1, x.shape[-1]), spec)
    assert torch.equal(q.data.reshape(q2.data.shape).view(torch.uint8), q2.data.view(torch.uint8))


@given(s=st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False))
def test_round_up_to_pow2(s):
    t = torch.tensor([s], dtype=torch.float32)
    r = f8.round_up_to_pow2(t)
    mant, _ = torch.frexp(r)
    assert mant.item() == 0.5 and r.item() >= t.item() and r.item() < 2 * t.item()


def test_round_up_to_pow2_keeps_powers_and_nonfinite():
    t = torch.tensor([1.0, 2.0**-100, 2.0**100, float("inf"), float("nan")])
    r = f8.round_up_to_pow2(t)
    assert torch.equal(r[:4], t[:4]) and torch.isnan(r[4])


def test_dequantize_default_dtype_and_bf16():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q = f8.quantize(x, f8.CastSpec())
    assert f8.dequantize(q).dtype == torch.bfloat16
    assert torch.equal(f8.dequantize(q, torch.float32), q.data.float() * q.scale)


def test_empty_tensor():
    for g in [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0)]:
        q = f8.quantize(torch.empty(0, 16), f8.CastSpec(granularity=g))
        assert q.data.shape == (0, 16) and torch.isfinite(q.scale).all()


@given(x=tensors(shapes_2d(mult=(4, 4)), specials=True), dtype=st.sampled_from(DTYPES), p2=st.booleans(),
       square=st.booleans())
def test_transposed_copy_with_the_forward_scales_is_a_fresh_cast(x, dtype, p2, square):
    """``linear`` casts the transposed copy of a tensorwise / square-block operand with the forward
    cast's scales instead of a second amax (``_casts.cast``): bitwise a fresh cast of ``x.T``."""
    from fp8func._casts import cast

    spec = f8.CastSpec(dtype=dtype, granularity=f8.BlockWise((4, 4)) if square else f8.TensorWise(), power_of_2=p2)
    q, q_t = cast(x, spec, transpose=True)
    fresh = f8.quantize(x.t(), spec)
    assert torch.equal(q_t.data.view(torch.uint8), fresh.data.view(torch.uint8))
    assert torch.equal(q_t.scale.nan_to_num(nan=-1.0), fresh.scale.nan_to_num(nan=-1.0))


@given(x=tensors(shapes_nd(3, 3), specials=True), perm=st.permutations(range(3)))
def test_tensorwise_amax_of_a_permuted_view(x, perm):
    """The tensorwise amax reduces a non-contiguous view in memory order: the same value."""
    from fp8func._scaling import compute_amax

    v = x.permute(perm)
    expect = x.abs().max().float().reshape(1, 1, 1)
    assert torch.equal(compute_amax(v, f8.TensorWise()).nan_to_num(nan=-1.0), expect.nan_to_num(nan=-1.0))


@given(x=tensors(shapes_2d(mult=(1, 1)), specials=True), gi=st.integers(0, 3), transposed=st.booleans())
def test_amax_dispatch_is_compute_amax(x, gi, transposed):
    """``_casts._amax`` (FSDP2's scale-only pass) takes the amax kernel where one applies (its
    twin here) and ``compute_amax`` otherwise: the same bits, NaN included."""
    import fp8func._casts as casts_mod
    from fp8func._scaling import compute_amax

    g = [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.BlockWise((1, 1))][gi]
    t = x.t() if transposed else x  # a transposed view: not contiguous, so no kernel
    got = casts_mod.amax_for_cast(t, g, "reference")
    want = compute_amax(t, g)
    assert got.shape == want.shape and torch.equal(got.nan_to_num(nan=-1.0), want.nan_to_num(nan=-1.0))


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
@pytest.mark.parametrize("g", [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.BlockWise((1, 128)),
                               f8.BlockWise((128, 128)), f8.MX(32)], ids=repr)
@pytest.mark.parametrize("dtype", [f8.E4M3, f8.E5M2])
@pytest.mark.parametrize("p2", [False, True])
def test_cuda_quantize_bitwise_equals_cpu_and_compiled(g, dtype, p2):
    spec = f8.CastSpec(dtype, g, p2)
    x = torch.randn(512, 1024) * 3
    x[3, 5] = 1e4  # an outlier that saturates nothing but sets a scale
    cpu = f8.quantize(x, spec)
    gpu = f8.quantize(x.cuda(), spec)
    torch._dynamo.reset()
    comp = torch.compile(lambda t: f8.quantize(t, spec), fullgraph=True)(x.cuda())
    for q in (gpu, comp):
        assert torch.equal(q.data.view(torch.uint8).cpu(), cpu.data.view(torch.uint8))
        assert torch.equal(q.scale.cpu(), cpu.scale)
