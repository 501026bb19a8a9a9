"""gemm: emulated path against float64, hardware path (CPU scaled_mm) against emulated."""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8func as f8
from fp8func import _gemm
from fp8func._log import forget

PAIRS = {  # (a granularity on [M, K], b granularity on [K, N])
    "tensorwise": (f8.TensorWise(), f8.TensorWise()),
    "rowwise": (f8.AxisWise(-1), f8.AxisWise(0)),
    "row_x_tensor": (f8.AxisWise(-1), f8.TensorWise()),
    "block_1x128_128x128": (f8.BlockWise((1, 128)), f8.BlockWise((128, 128))),
    "block_1x128_128x1": (f8.BlockWise((1, 128)), f8.BlockWise((128, 1))),
    "mx": (f8.MX(32), f8.MX(32, axis=0)),
}


def _operands(m, k, n, pair, dtype_a=f8.E4M3, dtype_b=f8.E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    a_hp = torch.randn(m, k, generator=g)
    b_hp = torch.randn(k, n, generator=g)
    ga, gb = PAIRS[pair]
    return a_hp, b_hp, f8.quantize(a_hp, f8.CastSpec(dtype_a, ga)), f8.quantize(b_hp, f8.CastSpec(dtype_b, gb))


@pytest.mark.parametrize("pair", list(PAIRS))
def test_emulated_is_exact_product_of_dequantized(pair):
    a_hp, b_hp, a, b = _operands(256, 256, 128, pair)
    y = f8.gemm(a, b, out_dtype=torch.float32, path="emulated")
    ref = f8.dequantize(a, torch.float64) @ f8.dequantize(b, torch.float64)
    assert f8.sqnr(ref, y) > 120  # fp32 accumulation of exactly representable products
    assert f8.sqnr(a_hp.double() @ b_hp.double(), y) > 24


@pytest.mark.parametrize("pair", ["tensorwise", "rowwise", "row_x_tensor"])
@pytest.mark.parametrize("dtypes", [(f8.E4M3, f8.E4M3), (f8.E5M2, f8.E4M3), (f8.E4M3, f8.E5M2)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_hardware_path_matches_emulated_on_cpu(pair, dtypes, out_dtype):
    _, _, a, b = _operands(64, 96, 48, pair, *dtypes)
    assert f8.gemm_path(a, b, "hardware") == f"scaled_mm_{'tensorwise' if pair == 'tensorwise' else 'rowwise'}"
    hw = f8.gemm(a, b, out_dtype=out_dtype, path="hardware")
    em = f8.gemm(a, b, out_dtype=out_dtype, path="emulated")
    assert hw.dtype == em.dtype == out_dtype
    torch.testing.assert_close(hw, em, rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=1e-5)


def test_b_operand_in_any_layout():
    _, b_hp, a, _ = _operands(32, 64, 32, "rowwise")
    b_row = f8.quantize(b_hp.contiguous(), f8.CastSpec(granularity=f8.AxisWise(0)))
    b_col = f8.quantize(b_hp.t().contiguous(), f8.CastSpec(granularity=f8.AxisWise(-1))).t()
    assert torch.equal(b_row.data.view(torch.uint8), b_col.data.view(torch.uint8))
    for b in (b_row, b_col):
        torch.testing.assert_close(f8.gemm(a, b, torch.float32, path="hardware"),
                                   f8.gemm(a, b, torch.float32, path="emulated"), rtol=1e-5, atol=1e-5)


def _packed_views(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp8 [m, k] views into one packed byte buffer, each row followed by 4 bytes of a row
    scale, the way an FP8 sequence gather packs two casts and their scales: a row pitch of
    2k + 8 bytes, and the second view starting k + 4 bytes in."""
    buf = torch.randint(0, 120, (m, 2 * k + 8), dtype=torch.uint8)
    return buf[:, :k].view(f8.E4M3), buf[:, k + 4:2 * k + 4].view(f8.E4M3)


def test_operand_layouts_meet_cublaslt_alignment():
    # cuBLASLt's FP8 GEMMs want a 16-byte aligned start and leading dimension; a view into a
    # packed buffer has neither, and is copied (same values), while a proper layout is kept as is.
    first, second = _packed_views(32, 64)
    for view in (first, second):
        for fix in (_gemm._row_major, _gemm.col_major):
            out = fix(view)
            assert out is not view and torch.equal(out.view(torch.uint8), view.view(torch.uint8))
            pitch = out.stride(0) if fix is _gemm._row_major else out.stride(1)
            assert pitch % 16 == 0 and out.storage_offset() % 16 == 0, (out.stride(), out.storage_offset())
    row = torch.zeros(32, 64, dtype=torch.uint8).view(f8.E4M3)
    assert _gemm._row_major(row) is row and _gemm.col_major(row.t()).data_ptr() == row.data_ptr()
    assert _gemm._row_major(row.t()) is not row  # column-major: copied row-major


def test_gemm_of_packed_views_is_the_gemm_of_their_copies():
    first, second = _packed_views(32, 64)
    scale = torch.ones(32, 1)
    a = f8.Fp8Tensor(first, scale, f8.quantize(torch.ones(32, 64), f8.CastSpec(granularity=f8.AxisWise(-1))).meta)
    b = f8.Fp8Tensor(second, scale, a.meta).t()
    a_copy = f8.Fp8Tensor(first.contiguous(), scale, a.meta)
    b_copy = f8.Fp8Tensor(second.contiguous(), scale, a.meta).t()
    assert torch.equal(f8.gemm(a, b, torch.float32, path="hardware"),
                       f8.gemm(a_copy, b_copy, torch.float32, path="hardware"))


def test_bias_is_added_in_out_dtype():
    _, _, a, b = _operands(16, 32, 16, "tensorwise")
    bias = torch.randn(16)
    y = f8.gemm(a, b, torch.bfloat16, bias=bias, path="emulated")
    assert torch.equal(y, f8.gemm(a, b, torch.bfloat16, path="emulated") + bias.bfloat16())


def test_path_selection_on_cpu():
    _, _, a, b = _operands(32, 128, 128, "tensorwise")
    assert f8.gemm_path(a, b) == "emulated"  # auto on CPU: the fp32 reference
    assert f8.gemm_path(a, b, "emulated") == "emulated"
    _, _, a, b = _operands(128, 128, 128, "block_1x128_128x128")
    with pytest.raises(ValueError, match="the CPU build has no blockwise scaled_mm"):
        f8.gemm_path(a, b, "hardware")
    _, _, a, b = _operands(32, 64, 64, "mx")
    with pytest.raises(ValueError, match=r"no scaled_mm kernel for a=MX\(block=32, axis=-1\)"):
        f8.gemm_path(a, b, "hardware")


def test_hardware_kind_reasons():
    _, _, a, b = _operands(32, 40, 64, "tensorwise")
    assert _gemm.hardware_kind(a, b) == (None, "scaled_mm needs K and N divisible by 16, got K=40, N=64")
    _, _, a, b = _operands(32, 64, 64, "tensorwise", f8.E5M2, f8.E5M2)
    assert _gemm.hardware_kind(a, b)[1] == "e5m2 x e5m2 has no FP8 tensor-core GEMM"
    assert f8.gemm(a, b, torch.float32).shape == (32, 64)  # still computable: emulated


def test_fallback_logged_once_per_reason(caplog):
    forget(("emulated gemm", "test reason"))
    with caplog.at_level(logging.WARNING, logger="fp8func"):
        _gemm.log_fallback("test reason")
        _gemm.log_fallback("test reason")
    hits = [r for r in caplog.records if "test reason" in r.getMessage()]
    assert len(hits) == 1 and "emulated FP8 GEMM on a GPU" in hits[0].getMessage()


@given(m=st.integers(1, 40), kq=st.integers(1, 4), nq=st.integers(1, 4), seed=st.integers(0, 2**20),
       pair=st.sampled_from(["tensorwise", "rowwise", "row_x_tensor"]))
def test_hardware_vs_emulated_random_shapes(m, kq, nq, seed, pair):
    _, _, a, b = _operands(m, 16 * kq, 16 * nq, pair, seed=seed)
    torch.testing.assert_close(f8.gemm(a, b, torch.float32, path="hardware"),
                               f8.gemm(a, b, torch.float32, path="emulated"), rtol=1e-5, atol=1e-4)


def test_operand_errors():
    _, _, a, b = _operands(16, 32, 16, "tensorwise")
    with pytest.raises(TypeError, match="b is a Tensor; expected an Fp8Tensor"):
        f8.gemm(a, torch.randn(32, 16))
    with pytest.raises(ValueError, match=r"a is \(16, 32\) and b is \(16, 32\); inner dims must match"):
        f8.gemm(a, b.t())
    with pytest.raises(ValueError, match="path='fast'; expected 'auto', 'hardware' or 'emulated'"):
        f8.gemm(a, b, path="fast")
    q3 = f8.quantize(torch.randn(2, 16, 32), f8.CastSpec())
    with pytest.raises(ValueError, match=r"a has shape \(2, 16, 32\); expected 2 dims"):
        f8.gemm(q3, b)


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


HW_PAIRS = [  # (a granularity [M, K], b granularity [K, N], dtype a, dtype b, expected kind)
    (f8.TensorWise(), f8.TensorWise(), f8.E4M3, f8.E4M3, "tensorwise"),
    (f8.TensorWise(), f8.TensorWise(), f8.E5M2, f8.E4M3, "tensorwise"),
    (f8.TensorWise(), f8.TensorWise(), f8.E4M3, f8.E5M2, "tensorwise"),
    (f8.AxisWise(-1), f8.AxisWise(0), f8.E4M3, f8.E4M3, "rowwise"),
    (f8.AxisWise(-1), f8.TensorWise(), f8.E4M3, f8.E4M3, "rowwise"),
    (f8.BlockWise((1, 128)), f8.BlockWise((128, 128)), f8.E4M3, f8.E4M3, "blockwise"),
    (f8.BlockWise((1, 128)), f8.BlockWise((128, 1)), f8.E4M3, f8.E4M3, "blockwise"),
]
SHAPES = [(256, 512, 384), (1024, 1024, 2048), (384, 640, 256)]  # (M, K, N); K/128 = 5 exercises padding


def _ids(p):
    return f"{p[4]}-{p[0]!r}-{p[1]!r}-{p[2]}-{p[3]}".replace(" ", "")


@pytest.mark.gpu
@pytest.mark.parametrize("pair", HW_PAIRS, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_hardware_matches_emulated(pair, shape, out_dtype):
    ga, gb, da, db, kind = pair
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = f8.quantize(torch.randn(m, k, device="cuda", generator=g), f8.CastSpec(da, ga))
    # b is cast along K the way linear does it: quantize [N, K] row-major, then transpose.
    gb_t = f8.AxisWise(-1) if gb == f8.AxisWise(0) else (f8.BlockWise((1, 128)) if gb == f8.BlockWise((128, 1)) else gb)
    b = f8.quantize(torch.randn(n, k, device="cuda", generator=g), f8.CastSpec(db, gb_t)).t()
    assert b.granularity == gb
    assert f8.gemm_path(a, b) == f"scaled_mm_{kind}"
    hw = f8.gemm(a, b, out_dtype)
    em = f8.gemm(a, b, out_dtype, path="emulated")
    assert hw.dtype == out_dtype
    ref = f8.dequantize(a, torch.float64) @ f8.dequantize(b, torch.float64)
    # Same products, other accumulation order (and the output rounding). Hopper's FP8 tensor
    # cores accumulate with fewer bits than fp32 (cuBLAS promotes to fp32 only between MMA
    # chunks), so an fp32 output lands near 78 dB, not at the ~130 dB of an fp32 matmul; 70 dB
    # still fails an output that went through bf16 (about 55 dB here).
    floor = 45 if out_dtype == torch.bfloat16 else 70
    assert f8.sqnr(ref, hw) > floor, (f8.sqnr(ref, hw), f8.sqnr(ref, em))
    assert f8.sqnr(ref, em) > floor


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tensorwise", "rowwise"])
def test_hardware_gemm_of_packed_views_is_bitwise_the_gemm_of_their_copies(kind):
    """Operands that are views into one packed buffer (row pitch 2K + 8 bytes, the second 68
    bytes in: how an FP8 sequence gather packs two casts and their row scales): cuBLASLt takes
    neither layout, so the GEMM lays them out again, to the same bits as contiguous copies."""
    m, k, n = 256, 512, 384
    g = torch.Generator(device="cuda").manual_seed(0)
    gran = f8.TensorWise() if kind == "tensorwise" else f8.AxisWise(-1)
    qa = f8.quantize(torch.randn(m, k, device="cuda", generator=g), f8.CastSpec(granularity=gran))
    qb = f8.quantize(torch.randn(n, k, device="cuda", generator=g), f8.CastSpec(granularity=gran))
    buf = torch.zeros(max(m, n), 2 * k + 8, dtype=torch.uint8, device="cuda")
    buf[:m, :k] = qa.data.view(torch.uint8)
    buf[:n, k + 4:2 * k + 4] = qb.data.view(torch.uint8)
    a = f8.Fp8Tensor(buf[:m, :k].view(qa.dtype), qa.scale, qa.meta)
    b = f8.Fp8Tensor(buf[:n, k + 4:2 * k + 4].view(qb.dtype), qb.scale, qb.meta).t()
    assert f8.gemm_path(a, b) == f"scaled_mm_{kind}"
    assert torch.equal(f8.gemm(a, b, torch.bfloat16), f8.gemm(qa, qb.t(), torch.bfloat16))


@pytest.mark.gpu
def test_mx_on_hopper_falls_back_loudly(caplog):
    cap = torch.cuda.get_device_capability()
    if cap >= (10, 0):
        pytest.skip("Blackwell has MX GEMMs; the fallback is a Hopper behaviour")
    a = f8.quantize(torch.randn(128, 256, device="cuda"), f8.CastSpec(granularity=f8.MX(32)))
    b = f8.quantize(torch.randn(64, 256, device="cuda"), f8.CastSpec(granularity=f8.MX(32))).t()
    forget()
    with caplog.at_level(logging.WARNING, logger="fp8func"):
        assert f8.gemm_path(a, b) == "emulated"
        f8.gemm(a, b)
    assert sum("emulated FP8 GEMM on a GPU" in r.getMessage() for r in caplog.records) == 1


def _chunk_scaled(chunks: list, granularity) -> f8.Fp8Tensor:
    """Casts of consecutive row chunks side by side, one scale per chunk (``BlockWise((rows, K))``)
    or that scale on every row of its chunk (``AxisWise(-1)``)."""
    data = torch.cat([q.data.view(torch.uint8) for q in chunks]).view(chunks[0].dtype)
    scale = torch.cat([q.scale for q in chunks])
    if isinstance(granularity, f8.AxisWise):
        scale = scale.repeat_interleave(chunks[0].shape[0], dim=0)
    meta = f8.Fp8Meta(chunks[0].spec.with_granularity(granularity), torch.float32, None)
    return f8.Fp8Tensor(data, scale, meta)


@pytest.mark.parametrize("path", ["emulated", "hardware"])
def test_gemm_of_operands_scaled_per_chunk_of_rows(path):
    """Scales constant over chunks of 32 rows (a sequence gathered with one scale per rank's
    chunk): as the rows of a GEMM, the row-wise kernel, bitwise per-row scales; along the
    contraction, one tensorwise GEMM per chunk, summed in fp32 in chunk order, rounded once."""
    g = torch.Generator().manual_seed(0)
    chunks = [f8.quantize(torch.randn(32, 64, generator=g) * 10.0 ** i, f8.CastSpec()) for i in range(3)]
    blocks = _chunk_scaled(chunks, f8.BlockWise((32, 64)))
    rows = _chunk_scaled(chunks, f8.AxisWise(-1))
    w = f8.quantize(torch.randn(48, 64, generator=g), f8.CastSpec())
    assert _gemm.hardware_kind(blocks, w.t()) == ("rowwise", "")
    assert torch.equal(f8.gemm(blocks, w.t(), torch.float32, path=path), f8.gemm(rows, w.t(), torch.float32, path=path))
    dy = f8.quantize(torch.randn(96, 48, generator=g), f8.CastSpec(f8.E5M2))
    assert _gemm.contraction_chunk(dy.t(), blocks) == 32
    assert f8.gemm_path(dy.t(), blocks, path) == ("emulated" if path == "emulated" else "scaled_mm_tensorwise")
    total = 0
    for c, q in enumerate(chunks):
        dy_c = f8.Fp8Tensor(dy.data[32 * c:32 * (c + 1)], dy.scale, dy.meta)
        total = total + f8.gemm(dy_c.t(), q, torch.float32, path=path)
    assert torch.equal(f8.gemm(dy.t(), blocks, torch.bfloat16, path=path), total.to(torch.bfloat16))
    # Compiled, the per-chunk GEMMs are one opaque op (fp8func::scaled_mm_chunks) running the same code.
    compiled = torch.compile(lambda a, b: f8.gemm(a, b, torch.bfloat16, path=path), fullgraph=True)
    assert torch.equal(compiled(dy.t(), blocks), total.to(torch.bfloat16))
    exact = dy.data.float().t() @ f8.dequantize(rows, torch.float32) * dy.scale
    assert f8.sqnr(exact, f8.gemm(dy.t(), blocks, torch.float32, path=path)) > 60
