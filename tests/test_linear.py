"""linear: values and every gradient against float64, torch.func transforms, compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vjp, vmap

import fp8func as f8

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"]
# SQNR floors in dB (measured ~31 / ~25 dB for e4m3 / e5m2 casts of gaussian data; a bug costs
# far more than the margin). Each GEMM's error is about that of its worst operand.
SQNR = {
    "tensorwise": {"y": 24, "dx": 19, "dw": 19},
    "rowwise": {"y": 25, "dx": 25, "dw": 25},
    "rowwise_with_gw_hp": {"y": 25, "dx": 25, "dw": 60},
    "blockwise": {"y": 25, "dx": 25, "dw": 25},
    "mxfp8": {"y": 24, "dx": 24, "dw": 24},
}


def _problem(m=256, k=256, n=128, dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    dy = torch.randn(2, m // 2, n, generator=g).to(dtype)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("recipe", RECIPES)
def test_values_and_grads_vs_float64(recipe):
    x, w, b, dy = _problem()
    y, dx, dw, db = _grads(lambda x, w, b: f8.linear(x, w, b, recipe=recipe), x, w, b, dy)
    ry, rdx, rdw, rdb = _grads(F.linear, x.double(), w.double(), b.double(), dy.double())
    floors = SQNR[recipe]
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert f8.sqnr(ry, y) > floors["y"], f8.sqnr(ry, y)
    assert f8.sqnr(rdx, dx) > floors["dx"], f8.sqnr(rdx, dx)
    assert f8.sqnr(rdw, dw) > floors["dw"], f8.sqnr(rdw, dw)
    torch.testing.assert_close(db.double(), rdb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_activations_fp32_master_weight(recipe):
    x, w, b, dy = _problem(dtype=torch.bfloat16)
    y, dx, dw, db = _grads(lambda x, w, b: f8.linear(x, w, b, recipe=recipe), x, w, b, dy)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    ry = F.linear(x.double(), w.double(), b.double())
    assert f8.sqnr(ry, y) > SQNR[recipe]["y"] - 1


def test_backward_matches_the_explicit_gemms():
    """The autograd.Function computes exactly the three GEMMs the docs describe (tensorwise)."""
    x, w, _, dy = _problem(bias=False)
    r = f8.Recipe.from_name("tensorwise")
    y, dx, dw, _ = _grads(lambda x, w, b: f8.linear(x, w, recipe=r), x, w, None, dy)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    qx, qw, qdy = f8.quantize(x2, r.input), f8.quantize(w, r.weight), f8.quantize(dy2, r.grad_output)
    assert torch.equal(y.reshape(-1, w.shape[0]), f8.gemm(qx, qw.t(), torch.float32))
    assert torch.equal(dx.reshape(x2.shape), f8.gemm(qdy, qw, torch.float32))
    assert torch.equal(dw, f8.gemm(f8.quantize(dy2.t(), r.grad_output), qx, torch.float32))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_reused_casts_equal_fresh_transposed_casts(recipe):
    """Saving the forward's fp8 x / w is only legal because re-casting the transpose is bitwise equal."""
    r = f8.Recipe.from_name(recipe)
    x, w, _, _ = _problem()
    x2 = x.reshape(-1, x.shape[-1])
    for t, spec in ((x2, r.input), (w, r.weight)):
        if isinstance(spec.granularity, f8.BlockWise) and spec.granularity.block[0] != spec.granularity.block[1]:
            continue
        a, bt = f8.quantize(t, spec), f8.quantize(t.t(), spec).t()
        assert torch.equal(a.data.view(torch.uint8), bt.data.view(torch.uint8))
        assert torch.equal(a.scale, bt.scale)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_hardware_path_on_cpu_matches_emulated(recipe):
    x, w, b, dy = _problem()
    hw = f8.Recipe.from_name(recipe, path="hardware")
    em = f8.Recipe.from_name(recipe, path="emulated")
    out_hw = _grads(lambda x, w, b: f8.linear(x, w, b, recipe=hw), x, w, b, dy)
    out_em = _grads(lambda x, w, b: f8.linear(x, w, b, recipe=em), x, w, b, dy)
    for a, e in zip(out_hw, out_em):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_torch_func_grad_and_vjp_match_autograd():
    x, w, b, dy = _problem(m=64, k=64, n=32)
    r = f8.Recipe.from_name("rowwise")
    _, dx, dw, db = _grads(lambda x, w, b: f8.linear(x, w, b, recipe=r), x, w, b, dy)
    gx, gw, gb = grad(lambda x, w, b: (f8.linear(x, w, b, recipe=r) * dy).sum(), argnums=(0, 1, 2))(x, w, b)
    assert torch.equal(gx, dx) and torch.equal(gw, dw) and torch.equal(gb, db)
    _, pullback = vjp(lambda x, w: f8.linear(x, w, b, recipe=r), x, w)
    vx, vw = pullback(dy)
    assert torch.equal(vx, dx) and torch.equal(vw, dw)


def test_vmap_is_per_example():
    """vmap over a batch gives each example its own (tensorwise) scales, like a Python loop."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 16, 64, generator=g) * torch.tensor([1.0, 100.0, 0.01]).view(3, 1, 1)
    w = torch.randn(32, 64, generator=g)
    batched = vmap(lambda x: f8.linear(x, w, recipe="tensorwise"))(xs)
    looped = torch.stack([f8.linear(x, w, recipe="tensorwise") for x in xs])
    assert torch.equal(batched, looped)
    # Per-example gradients: vmap(grad) over weights and inputs.
    ws = torch.randn(3, 32, 64, generator=g)
    per_ex = vmap(grad(lambda w, x: f8.linear(x, w, recipe="rowwise").square().sum()))(ws, xs)
    loop = torch.stack([grad(lambda w: f8.linear(x, w, recipe="rowwise").square().sum())(w_) for w_, x in zip(ws, xs)])
    assert torch.equal(per_ex, loop)


def test_functional_call_over_module_params():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32, 64))
            self.bias = torch.nn.Parameter(torch.zeros(32))

        def forward(self, x):
            return f8.linear(x, self.weight, self.bias, recipe="tensorwise")

    model, x = Tiny(), torch.randn(8, 64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads = grad(lambda p: functional_call(model, p, (x,)).square().sum())(params)
    model(x).square().sum().backward()
    assert torch.equal(grads["weight"], model.weight.grad) and torch.equal(grads["bias"], model.bias.grad)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_compile_fullgraph_matches_eager(recipe):
    torch._dynamo.reset()
    x, w, b, dy = _problem(m=128, k=128, n=128)
    fn = lambda x, w, b: f8.linear(x, w, b, recipe=recipe)  # noqa: E731
    eager = _grads(fn, x, w, b, dy)
    compiled = _grads(torch.compile(fn, fullgraph=True), x, w, b, dy)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_linear_errors():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"x has shape \(4, 64\) and weight \(32, 63\); expected x \[..., K\]"):
        f8.linear(x, torch.randn(32, 63))
    with pytest.raises(ValueError, match=r"bias has shape \(31,\); expected \(32,\)"):
        f8.linear(x, w, torch.randn(31))
    with pytest.raises(ValueError, match="unknown recipe; expected one of"):
        f8.linear(x, w, recipe="fp4")
    with pytest.raises(TypeError, match="expected a Recipe, a LinearPlan or a recipe name"):
        f8.linear(x, w, recipe=3)
    with pytest.raises(ValueError,
                       match=r"plan 'blockwise' on M=4, K=64, N=32: the output GEMM's input x cast cannot tile"):
        f8.linear(x, w, recipe="blockwise")
    with pytest.raises(ValueError, match=r"the grad_weight GEMM's grad_output dy.T cast cannot tile its operand"):
        f8.linear(torch.randn(64, 128), torch.randn(128, 128), recipe="blockwise")


def test_no_grad_forward_and_partial_grads():
    x, w, b, dy = _problem(m=32, k=64, n=32)
    with torch.no_grad():
        y = f8.linear(x, w, b)
    assert not y.requires_grad
    y_full, _, dw_full, _ = _grads(lambda x, w, b: f8.linear(x, w, b), x, w, b, dy)
    assert torch.equal(y, y_full.detach())  # the same forward, without the copies for the backward
    wp = w.clone().requires_grad_()
    f8.linear(x, wp).backward(dy)  # only the weight needs a gradient
    assert torch.equal(wp.grad, dw_full)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"])
def test_linear_through_the_kernel_twins_is_bitwise_the_plain_casts(recipe, monkeypatch):
    """kernels="reference" routes every cast that has a fused kernel through the kernel dispatch
    (its PyTorch twin here; the Triton kernel on a GPU, the `gpu` tests below): same bits."""
    import fp8func.kernels as kernels

    calls = []
    orig = kernels.quantize
    monkeypatch.setattr(kernels, "quantize", lambda *a, **k: calls.append(k.get("transpose", False)) or orig(*a, **k))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, 256, generator=g).bfloat16()
    w = torch.randn(384, 256, generator=g) / 16
    dy = torch.randn(2, 128, 384, generator=g).bfloat16()
    runs = {}
    for mode in ("off", "reference"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f8.linear(xx, ww, recipe=f8.Recipe.from_name(recipe, kernels=mode))
        y.backward(dy)
        runs[mode] = (y, xx.grad, ww.grad)
    # x, w and dy (with its transpose) go through the kernels; MX has no kernel
    assert len(calls) == (0 if recipe == "mxfp8" else 3), calls
    # Transposed copies: dy always (grad_weight); x in the forward where the kernels write the
    # backward's cast with the forward's (tensorwise, row-wise, 1x128 blocks); w where the backward
    # keeps its fp8 cast anyway (tensorwise, 128x128 blocks), not row-wise (see _casts.forward_transposes).
    transposed = {"tensorwise": 3, "rowwise": 2, "blockwise": 3}.get(recipe, 0)
    assert sum(calls) == transposed, calls
    for a, b in zip(runs["off"], runs["reference"]):
        assert torch.equal(a, b)


def test_kernel_granularities_are_the_kernels_own():
    """``_has_kernel`` (written without equality tests, for cheap compile guards) names exactly the
    granularities ``fp8func.kernels`` quantizes; the others raise there."""
    import fp8func.kernels as kernels
    from fp8func._casts import _has_kernel

    x = torch.randn(256, 256)
    for g in (f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(1), f8.AxisWise(0), f8.BlockWise((1, 128)),
              f8.BlockWise((128, 128)), f8.BlockWise((128, 1)), f8.BlockWise((1, 64)), f8.MX(32)):
        try:
            kernels.quantize(x, f8.CastSpec(granularity=g), impl="reference")
            supported = True
        except ValueError:
            supported = False
        assert _has_kernel(g) == supported, g


@pytest.mark.parametrize("dtensor", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: a one-rank process
@pytest.mark.parametrize("compiled", [False, True])
def test_backward_reads_a_given_weight_cast_after_its_refill(compiled, dtensor):
    # FSDP2's row-wise fp8 all-gather under reshard_after_forward: the forward's gather carries
    # the weight's ``w`` cast, and ``w_t`` (the grad_input GEMM's) shares its buffer until FSDP2
    # refills that buffer in its pre-backward hook. The backward must read ``w_t`` then. Under
    # compile, AOTAutograd's partitioner may compute an op that needs no gradient in the forward
    # graph and save its result, which would read w_t's buffer while it still holds w's bytes
    # (wrong gradients).
    # The test compiles with the partition that moves every such op (``_hoisting_partition``);
    # ``dtensor``: the operands are DTensors (a one-rank mesh), as under TP.
    if dtensor:
        from .dist_harness import run_workers

        assert run_workers(_refill_case, 1, compiled, True) == [(True, True)]
    else:
        assert _refill_case(0, 1, compiled, False) == (True, True)


def _refill_case(rank, world_size, compiled, dtensor):
    from fp8func._autograd import linear_with_casts
    from fp8func._casts import weight_casts

    recipe = f8.Recipe.from_name("rowwise")
    (_, spec_w), (_, spec_t) = weight_casts(recipe)
    torch.manual_seed(0)
    x0 = torch.randn(64, 128, dtype=torch.bfloat16)
    w_hp = torch.randn(32, 128, dtype=torch.bfloat16)
    qw, qt = f8.quantize(w_hp, spec_w), f8.quantize(w_hp, spec_t)
    buffer = qw.data.clone()  # as after the forward's all-gather: w's bytes where w_t will be
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        mesh = init_device_mesh("cpu", (world_size,))
        wrap = lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)  # noqa: E731
    else:
        wrap = lambda t: t  # noqa: E731

    def fn(x, w, w_data, w_scale, wt_data, wt_scale):
        casts = {"w": f8.Fp8Tensor(w_data, w_scale, qw.meta), "w_t": f8.Fp8Tensor(wt_data, wt_scale, qt.meta)}
        return linear_with_casts(x, w, None, recipe, casts)

    if compiled:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=_hoisting_partition)
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    x, w = x0.clone().requires_grad_(), w_hp.clone().requires_grad_()
    y = fn(wrap(x), wrap(w), *map(wrap, (qw.data, qw.scale, buffer, qt.scale)))
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
        buffer.copy_(qt.data)  # FSDP2's pre-backward all-gather refills the buffer with w_t
    y = y.to_local() if dtensor else y
    y.float().square().sum().backward()

    x_ref, w_ref = x0.clone().requires_grad_(), w_hp.clone().requires_grad_()
    f8.linear(x_ref, w_ref, None, recipe=recipe).float().square().sum().backward()
    return torch.equal(x.grad, x_ref.grad), torch.equal(w.grad, w_ref.grad)


def _hoisting_partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
    """AOTAutograd partition whose forward graph runs every op that needs no gradient: legal (the
    partitioners may put any such op there), and the worst case for a backward that reads a
    buffer refilled between the passes."""
    from torch._functorch.partitioners import default_partition

    graph = joint_module.graph
    needs_grad = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in needs_grad for a in node.all_input_nodes):
            needs_grad.add(node)
    first = next(n for n in graph.nodes if n in needs_grad and n.op != "placeholder")
    seen_first = False
    for node in list(graph.nodes):
        seen_first = seen_first or node is first
        if node.op in ("placeholder", "output") or node in needs_grad:
            continue
        if seen_first:
            first.prepend(node)  # its inputs need no gradient either: already before ``first``
        node.meta["partitioner_tag"] = "is_forward"
    graph.lint()
    joint_module.recompile()
    return default_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
