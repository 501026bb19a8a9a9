"""grouped_gemm / grouped_linear: casts, values and gradients against float64, empty groups,
torch.func and torch.compile, the hardware path's arguments against torch's kernel contract."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8func as f8
import fp8func._grouped as grouped_mod
from fp8func._grouped import (
    JaggedFp8Tensor,
    align_groups,
    dequantize_jagged,
    grouped_gemm,
    grouped_gemm_path,
    grouped_linear,
    grouped_mm,
    quantize_jagged,
)

ROW = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), power_of_2=True)
RECIPE = f8.Recipe.from_name("rowwise")
# SQNR floors in dB for e4m3 row-wise casts of gaussian data (measured ~28 dB vs float64).
FLOOR = 25


def _offs(sizes):
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int32), 0, dtype=torch.int32)


def _problem(sizes, k=32, n=48, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t, e = sum(sizes), len(sizes)
    x = (torch.randn(t, k, generator=g) * scale).to(dtype)
    w = torch.randn(e, n, k, generator=g) / k**0.5
    dy = (torch.randn(t, n, generator=g) * scale).to(dtype)
    return x, w, dy, _offs(sizes)


def _grads(fn, x, w, dy, offs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, offs)
    y.backward(dy)
    return y, x.grad, w.grad


def _spans(offs):
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _reference(x, w, dy, offs, spec=ROW):
    """float64 GEMMs of operands cast group by group with plain ``quantize`` (independent of _grouped)."""
    dq = lambda t, s: f8.dequantize(f8.quantize(t, s), torch.float64)  # noqa: E731
    xq, wq, dyq = dq(x, spec), dq(w, spec), dq(dy, spec)
    wq_n = dq(w.transpose(1, 2), spec).transpose(1, 2)  # [E, N, K] cast along N
    y, dx = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    dw = torch.zeros_like(w, dtype=torch.float64)
    for g, (s, e) in enumerate(_spans(offs)):
        y[s:e] = xq[s:e] @ wq[g].T
        dx[s:e] = dyq[s:e] @ wq_n[g]
        # per (expert, column) along the tokens of this group only: plain row-wise casts of the transposes
        dw[g] = dq(dy[s:e].t(), spec) @ dq(x[s:e].t(), spec).T
    return y, dx, dw


group_sizes = st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda s: sum(s) > 0)


@given(sizes=group_sizes, c=st.sampled_from([16, 32, 48]), dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**31 - 1), e=st.integers(-20, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantize_jagged_is_per_group_quantize_bitwise(sizes, c, dim, seed, e, dtype):
    """The jagged cast equals a plain row-wise ``quantize`` of each group's transpose, scales and bits;
    an empty group gets the EPS scale."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(sizes), c, generator=g) * 2.0**e).to(dtype)
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0
    offs = _offs(sizes)
    q = quantize_jagged(x if dim == 0 else x.t(), offs, ROW, dim=dim)
    q = q if dim == 0 else q.t()
    assert isinstance(q, JaggedFp8Tensor) and q.dim == 0 and q.scale.shape == (len(sizes), c)
    for gi, (s, e_) in enumerate(_spans(offs)):
        ref = f8.quantize(x[s:e_].t(), ROW)  # [C, M_g]: one scale per column of the group
        assert torch.equal(q.scale[gi], ref.scale[:, 0])
        assert torch.equal(q.data[s:e_].view(torch.uint8), ref.data.t().view(torch.uint8))
    assert torch.equal(dequantize_jagged(q, offs, torch.float32), torch.cat(
        [f8.dequantize(f8.quantize(x[s:e_].t(), ROW), torch.float32).t() for s, e_ in _spans(offs)]))


@given(sizes=group_sizes, seed=st.integers(0, 2**31 - 1), e=st.integers(-8, 8))
def test_values_and_grads_vs_float64_of_the_casts(sizes, seed, e):
    x, w, dy, offs = _problem(sizes, seed=seed, scale=2.0**e)
    y, dx, dw = _grads(grouped_linear, x, w, dy, offs)
    for got, ref in zip((y, dx, dw), _reference(x, w, dy, offs)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-30)


def test_sqnr_against_float64_and_plain_bf16():
    x, w, dy, offs = _problem([40, 0, 72, 16], k=64, n=96, dtype=torch.bfloat16)
    fp8 = _grads(grouped_linear, x, w, dy, offs)
    bf16 = _grads(grouped_mm, x, w.bfloat16(), dy, offs)
    f64 = _grads(grouped_mm, x.double(), w.double(), dy.double(), offs)
    assert fp8[0].dtype == fp8[1].dtype == torch.bfloat16 and fp8[2].dtype == torch.float32
    for name, a, b, r in zip(("y", "dx", "dw"), fp8, bf16, f64):
        assert f8.sqnr(r, a) > FLOOR, (name, f8.sqnr(r, a))
        assert f8.sqnr(b, a) > FLOOR, (name, f8.sqnr(b, a))
        assert f8.sqnr(r, b) > 40, (name, f8.sqnr(r, b))  # the bf16 baseline is itself close to float64


@pytest.mark.parametrize("sizes", [[0, 12, 0, 20, 0], [32, 0], [0, 0, 7]])
def test_empty_groups_give_zero_weight_gradients(sizes):
    x, w, dy, offs = _problem(sizes)
    y, dx, dw = _grads(grouped_linear, x, w, dy, offs)
    for g, n in enumerate(sizes):
        assert torch.equal(dw[g], torch.zeros_like(dw[g])) == (n == 0)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()


def test_grad_weight_hp_recipe_and_e5m2_grad_output():
    """Recipe variants: grad_weight in fp32 per group; e5m2 gradients with fp32 (non-pow2) scales."""
    x, w, dy, offs = _problem([5, 0, 11])
    hp = dataclasses.replace(RECIPE, grad_weight_hp=True, name="rowwise_gw_hp")
    _, _, dw = _grads(lambda x, w, o: grouped_linear(x, w, o, hp), x, w, dy, offs)
    ref = torch.stack([dy[s:e].t() @ x[s:e] for s, e in _spans(offs)])
    torch.testing.assert_close(dw, ref, rtol=1e-6, atol=1e-6)
    e5 = dataclasses.replace(RECIPE, grad_output=f8.CastSpec(f8.E5M2, f8.AxisWise(-1)), name="rowwise_e5m2")
    got = _grads(lambda x, w, o: grouped_linear(x, w, o, e5), x, w, dy, offs)
    ref = _reference(x, w, dy, offs, spec=ROW)
    assert f8.sqnr(ref[1], got[1]) > 20 and f8.sqnr(ref[2], got[2]) > 20


def test_torch_func_grad_vjp_and_compile_fullgraph_equal_eager_bitwise():
    torch._dynamo.reset()
    x, w, dy, offs = _problem([9, 0, 14, 9], dtype=torch.bfloat16)
    eager = _grads(grouped_linear, x, w, dy, offs)
    gx, gw = torch.func.grad(lambda x, w: (grouped_linear(x, w, offs) * dy).sum(), argnums=(0, 1))(x, w)
    _, pullback = torch.func.vjp(lambda x, w: grouped_linear(x, w, offs), x, w)
    vx, vw = pullback(dy)
    assert torch.equal(gx, eager[1]) and torch.equal(gw, eager[2])
    assert torch.equal(vx, eager[1]) and torch.equal(vw, eager[2])
    compiled = _grads(torch.compile(grouped_linear, fullgraph=True), x, w, dy, offs)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


def _scaled_grouped_mm_cpu(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
    """torch._scaled_grouped_mm on the CPU: torch's own argument checks (its meta function: layouts,
    strides, scale shapes), then the documented math with row-wise dequantization scales."""
    meta = lambda t: t.to("meta")  # noqa: E731  keeps strides
    torch.ops.aten._scaled_grouped_mm(meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), offs=meta(offs),
                                      out_dtype=out_dtype)
    kw.pop("use_fast_accum", None)  # the accumulator's precision: no effect on this model of the math
    assert out_dtype == torch.bfloat16 and not kw
    a, b, spans = mat_a.float(), mat_b.float(), _spans(offs)
    if mat_b.ndim == 3:  # 2d-3d: scale_a [M], scale_b [E, N]
        out = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(spans):
            out[s:e] = (a[s:e] * scale_a[s:e, None]) @ (b[g] * scale_b[g][None, :])
        return out.bfloat16()
    n, k = a.shape[0], b.shape[1]  # 2d-2d: scale_a [E*N], scale_b [E*K], group-major
    out = torch.zeros(len(spans), n, k)
    for g, (s, e) in enumerate(spans):
        out[g] = (a[:, s:e] * scale_a[g * n:(g + 1) * n, None]) @ (b[s:e] * scale_b[g * k:(g + 1) * k][None, :])
    return out.bfloat16()


def test_hardware_path_arguments_satisfy_the_kernel_contract(monkeypatch):
    """The scaled_grouped_mm call (layouts, scale shapes and order) against torch's meta checks and the
    kernel's documented math; numerically the emulated path up to the bf16 output rounding."""
    monkeypatch.setattr(grouped_mod, "_hardware_why", lambda kind, a, b: "")
    calls = []
    fake = lambda *a, **k: calls.append((a[1].ndim, k.get("use_fast_accum"))) or _scaled_grouped_mm_cpu(*a, **k)  # noqa: E731
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake)
    x, w, dy, offs = _problem([16, 32, 16], k=32, n=48, dtype=torch.bfloat16)
    hw = _grads(lambda x, w, o: grouped_linear(x, w, o, dataclasses.replace(RECIPE, path="hardware")), x, w, dy, offs)
    em = _grads(lambda x, w, o: grouped_linear(x, w, o, dataclasses.replace(RECIPE, path="emulated")), x, w, dy, offs)
    assert calls == [(3, False), (3, False), (2, False)]  # forward, grad_input (2d-3d), grad_weight (2d-2d)
    for a, b in zip(hw, em):
        assert f8.sqnr(b, a) > 45
    calls.clear()  # Recipe.fast_accum reaches each named GEMM's kernel, and only those
    fast = dataclasses.replace(RECIPE, path="hardware", fast_accum=("output", "grad_weight"))
    _grads(lambda x, w, o: grouped_linear(x, w, o, fast), x, w, dy, offs)
    assert calls == [(3, True), (3, False), (2, True)]
    qa, qb = f8.quantize(x, ROW), f8.quantize(w, ROW).transpose(1, 2)
    assert grouped_gemm_path(qa, qb, "hardware") == "scaled_grouped_mm"


def test_paths_on_cpu_and_errors():
    x, w, dy, offs = _problem([4, 0, 6])
    qa, qb = f8.quantize(x, ROW), f8.quantize(w, ROW).transpose(1, 2)
    assert grouped_gemm_path(qa, qb) == "emulated"
    with pytest.raises(ValueError, match=r"path='hardware'\): no FP8 grouped GEMM on device cpu"):
        grouped_gemm(qa, qb, offs, path="hardware")
    with pytest.raises(ValueError, match=r"offs is torch.int64 of shape \(3,\); expected an int32 vector of 3"):
        grouped_linear(x, w, offs.long())
    with pytest.raises(ValueError, match=r"offs=\[4, 3, 10\] must be non-decreasing group ends"):
        grouped_linear(x, w, torch.tensor([4, 3, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"last equal to the 10 rows"):
        grouped_linear(x, w, torch.tensor([4, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x has shape \(10, 32\) and w \(3, 48, 31\); expected x \[T, K\]"):
        grouped_linear(x, w[..., :31], offs)
    with pytest.raises(ValueError, match=r"recipe 'tensorwise' casts input with TensorWise\(\); grouped GEMMs"):
        grouped_linear(x, w, offs, "tensorwise")
    with pytest.raises(TypeError, match="expected Fp8Tensors a \\[M, K\\] and b \\[E, K, N\\]"):
        grouped_gemm(qa, qa, offs)
    with pytest.raises(ValueError, match="a grouped cast needs an AxisWise granularity"):
        quantize_jagged(x, offs, f8.CastSpec())


def test_align_groups_layout():
    offs = _offs([3, 0, 17, 16])
    index, aligned, rows = align_groups(offs, 16)
    assert aligned.tolist() == [16, 32, 64, 80] and rows == 80
    assert index.tolist() == [0, 1, 2] + list(range(32, 49)) + list(range(64, 80))
    x = torch.randn(36, 32)
    padded = torch.zeros(rows, 32).index_copy(0, index, x)
    q, qp = quantize_jagged(x, offs, ROW), quantize_jagged(padded, aligned, ROW)
    assert torch.equal(q.scale[[0, 2, 3]], qp.scale[[0, 2, 3]])  # zero rows change no amax


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [(), ("output", "grad_input", "grad_weight")], ids=["promoted", "fast_accum"])
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_linear_on_gpu_hardware_vs_emulated(compiled, fast_accum):
    """The row-wise FP8 grouped GEMMs (``torch._scaled_grouped_mm``) against the emulated twin:
    the same casts (bitwise, CUDA vs CPU), values and both gradients close; compiled == eager."""
    from fp8func._grouped import grouped_gemm_path, quantize_jagged

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [64, 0, 16, 176, 48, 208]  # multiples of 16 (the kernel's grad_weight contract), one empty
    offs = torch.cumsum(torch.tensor(sizes, device="cuda"), 0, dtype=torch.int32)
    x = torch.randn(sum(sizes), 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(len(sizes), 128, 256, device="cuda", generator=g) / 16).bfloat16()
    dy = torch.randn(sum(sizes), 128, device="cuda", generator=g).bfloat16()
    spec = f8.Recipe.from_name("rowwise").input
    q_gpu, q_cpu = quantize_jagged(x, offs, spec), quantize_jagged(x.cpu(), offs.cpu(), spec)
    assert torch.equal(q_gpu.scale.cpu(), q_cpu.scale)
    assert torch.equal(q_gpu.data.cpu().view(torch.uint8), q_cpu.data.view(torch.uint8))
    assert grouped_gemm_path(f8.quantize(x, spec), f8.quantize(w, spec).transpose(1, 2)) == "scaled_grouped_mm"
    runs = {}
    for recipe in (f8.Recipe.from_name("rowwise", fast_accum=fast_accum),
                   f8.Recipe.from_name("rowwise", path="emulated")):
        fn = lambda x, w: f8.grouped_linear(x, w, offs, recipe)  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(dy)
        runs[recipe.path] = (y, xx.grad, ww.grad)
        torch._dynamo.reset()
    for hw, em in zip(runs["auto"], runs["emulated"]):
        assert torch.isfinite(hw).all()
        assert f8.sqnr(em.double(), hw.double()) > 40, f8.sqnr(em.double(), hw.double())
    assert not runs["auto"][2][1].any()  # the empty group's weight gradient is exactly zero
