"""GPU evidence: the hardware FP8 GEMMs agree with the emulated path; CUDA casts equal CPU casts.

Marked ``gpu``: skipped (with the reason shown) where no FP8-capable CUDA GPU is visible.
"""

import copy
import logging
import re

import pytest
import torch

import fp8func as f8
from fp8func._log import forget

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"])
@pytest.mark.parametrize("compiled", [False, True])
# Inductor's performance hint for the fp32 matmuls of the emulated reference, which the
# _no_tf32 fixture keeps exact on purpose.
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning")
def test_linear_on_gpu_hardware_vs_emulated(recipe, compiled):
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 256, 512, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 512, device="cuda", generator=g) / 512**0.5)
    dy = torch.randn(4, 256, 1024, device="cuda", generator=g).bfloat16()

    def run(path):
        r = f8.Recipe.from_name(recipe, path=path)
        fn = lambda x, w: f8.linear(x, w, recipe=r)  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(dy)
        return y, xx.grad, ww.grad

    auto, emulated = run("auto"), run("emulated")
    for a, e in zip(auto, emulated):
        assert torch.isfinite(a).all()
        assert f8.sqnr(e, a) > 35, f8.sqnr(e, a)  # bf16 outputs of the same fp8 products


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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_with_triton_kernels_is_bitwise_the_plain_casts(recipe, compiled):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 256, 512, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 512, device="cuda", generator=g) / 512**0.5).bfloat16()
    dy = torch.randn(4, 256, 1024, device="cuda", generator=g).bfloat16()
    runs = {}
    for mode in ("off", "auto"):
        torch._dynamo.reset()
        fn = lambda x, w: f8.linear(x, w, recipe=f8.Recipe.from_name(recipe, kernels=mode))  # noqa: E731
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(dy)
        runs[mode] = (y, xx.grad, ww.grad)
    for a, b in zip(runs["off"], runs["auto"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_input_casts_on_gpu_are_bitwise_and_cast_once(recipe, compiled):
    """q, k and v reading one tensor (convert's share_input_casts): every output and gradient is
    bitwise the unshared model's, and eager, the Triton casts of the shared input run once per
    step (compiled code casts per layer: see fp8func.nn.SharedInputCasts)."""
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    class QKV(nn.Module):
        def __init__(self, dim=512):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

        def forward(self, x):
            h = x * 1.5  # an intermediate, as a norm's output is in a decoder layer
            return self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)

    torch.manual_seed(0)
    base = QKV().cuda().bfloat16()
    x = torch.randn(4, 256, 512, device="cuda").bfloat16()
    runs = {}
    for share in (False, True):
        torch._dynamo.reset()
        model = f8.convert(copy.deepcopy(base), recipe, fsdp_fp8_all_gather=False, share_input_casts=share)
        fn = torch.compile(model, fullgraph=True) if compiled else model
        xx = x.clone().requires_grad_()
        fn(xx).sum().backward()  # compile / warm up
        xx.grad = None
        for p in model.parameters():
            p.grad = None
        with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            y = fn(xx)
            y.sum().backward()
            torch.cuda.synchronize()
        # the input casts: kernels reading the [1024, 512] bf16 tensor (amax / quantize launches)
        casts = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                    and ("quant" in e.name or "amax" in e.name or "_cast" in e.name))
        runs[share] = ([y.detach(), xx.grad, *(p.grad for p in model.parameters())], casts)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0]))
    if compiled:
        assert runs[True][1] == runs[False][1], (runs[False][1], runs[True][1])
    else:
        assert runs[True][1] < runs[False][1], (runs[False][1], runs[True][1])


@pytest.mark.parametrize("compiled", [False, True])
def test_delayed_linear_with_triton_kernels_is_bitwise_the_plain_casts(compiled):
    """Delayed scaling through ``kernels.cast_amax`` (cast, transposed copy and amax in one pass)
    against the plain casts: output, gradients and all three next states (the states' gradients)."""
    from fp8func._delayed import LinearScalingState, ScalingState

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 256, 512, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 512, device="cuda", generator=g) / 512**0.5).bfloat16()
    dy = torch.randn(4, 256, 1024, device="cuda", generator=g).bfloat16()
    spec = f8.Recipe.from_name("delayed")
    state = LinearScalingState(ScalingState.from_tensor(x, spec.input, 4),
                               ScalingState.from_tensor(w / 4, spec.weight, 4),
                               ScalingState.from_tensor(dy * 8, spec.grad_output, 4))  # w's scale saturates
    runs = {}
    for mode in ("off", "auto"):
        recipe = f8.Recipe.from_name("delayed", kernels=mode)

        def step(x, w, *tensors):
            return f8.linear_delayed(x, w, None, recipe, LinearScalingState.from_tensors(tensors))[0]

        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True) if compiled else step
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        st = [t.clone().requires_grad_() for t in state.tensors()]
        y = fn(xx, ww, *st)
        y.backward(dy)
        runs[mode] = (y, xx.grad, ww.grad, *(t.grad for t in st))
    for a, b in zip(runs["off"], runs["auto"], strict=True):
        assert torch.equal(a, b)


# A launch of an fp8func kernel in inductor's code, and the buffer its x argument reads.
_KERNEL_LAUNCH = re.compile(
    r"\b(?:_amax_flat|_amax_2d|_cast|_quant|_quant_t)_kernel\w*\.run\(\s*(?:reinterpret_tensor\()?(\w+)")


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


def test_linear_fast_accum_on_gpu_stays_close_to_emulated():
    """``Recipe.fast_accum`` on the dense GEMMs: the hardware kernels run with ``use_fast_accum``
    and stay within bf16-output distance of the emulated twin (K=2048)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 2048, device="cuda", generator=g) / 45).bfloat16()
    dy = torch.randn(512, 1024, device="cuda", generator=g).bfloat16()
    for name in ("tensorwise", "rowwise"):
        runs = []
        for recipe in (f8.Recipe.from_name(name, fast_accum=("output", "grad_input", "grad_weight")),
                       f8.Recipe.from_name(name, path="emulated")):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = f8.linear(xx, ww, recipe=recipe)
            y.backward(dy)
            runs.append((y, xx.grad, ww.grad))
        for hw, em in zip(*runs):
            assert f8.sqnr(em.double(), hw.double()) > 40, (name, f8.sqnr(em.double(), hw.double()))


def _six_steps(recipe: str, mode: str):
    """Outputs and gradients of 6 fwd+bwd steps of a compiled Fp8Linear (fresh, seeded)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = f8.nn.Fp8Linear.from_linear(lin, f8.Recipe.from_name(recipe), fsdp_fp8_all_gather=False)
    cm = torch.compile(mod, mode=mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    outs = []
    for _ in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        mod.weight.grad = None
        y = cm(x)
        y.backward(torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, generator=g))
        state = mod.scaling_state()
        outs.append((y.detach().clone(), x.grad.clone(), mod.weight.grad.clone(),
                     *(() if state is None else (t.detach().clone() for t in state.tensors()))))
    torch.compiler.reset()
    return outs


# cudagraph trees capture some graphs empty here (torch's UserWarning; the replays still run them)
EMPTY_GRAPH = "ignore:The CUDA Graph is empty:UserWarning"


@pytest.mark.filterwarnings(EMPTY_GRAPH)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_under_cuda_graphs_is_bitwise_the_default_compile(recipe):
    """torch.compile(mode="reduce-overhead") (CUDA graphs) replays the same kernels: same bits."""
    for a, b in zip(_six_steps(recipe, "default"), _six_steps(recipe, "reduce-overhead")):
        for t, u in zip(a, b):
            assert torch.equal(t, u)


@pytest.mark.filterwarnings(EMPTY_GRAPH)
def test_delayed_linear_under_cuda_graphs():
    """The state buffers are written by the post-accumulate-grad hook after the graph replays,
    never rebound in the forward: CUDA graphs give the default compile's bits."""
    for a, b in zip(_six_steps("delayed", "default"), _six_steps("delayed", "reduce-overhead")):
        for t, u in zip(a, b):
            assert torch.equal(t, u)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_sequence_parallel_styles_compile_whole_on_gpu(recipe, compiled):
    """The fp8func sequence-parallel styles on a one-rank NCCL TP mesh, a block compiled with
    fullgraph=True (or eager): the Triton casts and the functional gathers run inside the graph,
    and every output and gradient is bitwise the stock styles'. The styles sit on a submodule, as
    in a decoder layer (the compiled module's own hooks are a separate graph in torch 2.11).
    Eager, the GEMMs read the gathered casts where they lie in the packed buffer (row-wise: two
    casts and their row scales per token), laid out again where cuBLASLt needs it."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

    class QKV(nn.Module):
        def __init__(self, dim=512):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x):
            return self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = QKV()

        def forward(self, x):
            return x + self.attn(x)

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        torch.manual_seed(0)
        base = Block().cuda().bfloat16()
        x = torch.randn(2, 512, 512, device="cuda").bfloat16()
        dy = torch.randn(2, 512, 512, device="cuda").bfloat16()
        runs = []
        for prep, col, row in ((PrepareFp8ModuleInput, Fp8ColwiseParallel, Fp8RowwiseParallel),
                               (PrepareModuleInput, ColwiseParallel, RowwiseParallel)):
            torch._dynamo.reset()
            model = f8.convert(copy.deepcopy(base), recipe, fsdp_fp8_all_gather=False)
            parallelize_module(model, mesh, {"attn": prep(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                                             "attn.q": col(), "attn.k": col(), "attn.v": col(),
                                             "attn.o": row(output_layouts=Shard(1))})
            fn = torch.compile(model, fullgraph=True) if compiled else model
            xx = x.clone().requires_grad_()
            y = fn(xx)
            y.backward(dy)
            runs.append([y.detach().clone(), xx.grad, *(p.grad.full_tensor() for p in model.parameters())])
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_precompute_amaxes_on_gpu_are_bitwise_the_hooks(param_dtype):
    """The multi-tensor amax of precompute_scales on CUDA (NaN, inf, ties, subnormals, empty):
    bitwise the amax of each shard cast to the param dtype."""
    from fp8func.distributed._fsdp import shard_amaxes, shard_amaxes_reference

    from .test_fsdp import _special_shards

    shards = _special_shards("cuda")
    dtypes = [param_dtype] * len(shards)
    fast, slow = shard_amaxes(shards, dtypes), shard_amaxes_reference(shards, dtypes)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32)), (fast, slow)


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
    for i, (x, a, b) in enumerate(zip(xs, fast, slow)):
        one = fk.cast(x, scales[i:i + 1, :1], spec, round_to=round_to, impl="triton")[0]
        assert a.shape == x.shape and a.dtype == dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
        assert torch.equal(a.view(torch.uint8), one.view(torch.uint8)), i
