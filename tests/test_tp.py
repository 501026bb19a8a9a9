"""Tensor parallel (DTensor) with Fp8Linear: global amaxes, finite losses, parity with one process."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fp8func as f8
import fp8func.distributed._tp as tp_mod

from .dist_harness import run_workers
from .models import batch, tiny_qwen3
from .test_fsdp import _CountAllGather

# every test here spawns processes (gloo or torchrun) or, on a GPU, compiles a TP block on a one-rank mesh
pytestmark = pytest.mark.slow

QWEN_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def qwen_sp_plans(fp8_styles: bool) -> tuple[dict, dict]:
    """Sequence parallel for an HF Qwen3 (torchtitan's layout): the residual stream is sharded
    along the sequence between the blocks; the attention and MLP inputs are gathered (in FP8 with
    the fp8func styles), their outputs reduce-scattered back. Returns (model plan, block plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

    prep, col, row = ((PrepareFp8ModuleInput, Fp8ColwiseParallel, Fp8RowwiseParallel) if fp8_styles
                      else (PrepareModuleInput, ColwiseParallel, RowwiseParallel))
    model_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": prep(input_kwarg_layouts={"hidden_states": Shard(1)},
                          desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
        "self_attn.o_proj": row(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": prep(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row(output_layouts=Shard(1)),
    }
    return model_plan, block_plan


def sp_forward(model, ids, labels):
    """HF Qwen3 with a sequence-sharded residual stream: positions and the (causal) mask are
    given for the whole sequence, as the embedding's output holds only this rank's tokens."""
    seq = ids.shape[1]
    return model(input_ids=ids, labels=labels, position_ids=torch.arange(seq)[None],
                 attention_mask={"full_attention": None}).loss


def _qwen_sp_losses(rank, world_size, recipe, steps, seq, fp8_styles):
    model = tiny_qwen3()
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        model_plan, block_plan = qwen_sp_plans(fp8_styles)
        parallelize_module(model, mesh, model_plan)
        for layer in model.model.layers:
            parallelize_module(layer, mesh, block_plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    losses = []
    for step in range(steps):
        ids, labels = batch(step, 0, batch_size=4, seq=seq)
        loss = sp_forward(model, ids, labels)
        loss.backward()
        for p in head_norms if world_size > 1 else ():
            torch.distributed.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _qwen_losses(rank, world_size, recipe, steps, tp):
    model = tiny_qwen3()
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    if tp:
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            parallelize_module(layer, mesh, QWEN_TP_PLAN)
    # FP8 training is chaotic at the rounding level: scaling the embeddings by (1 + 2**-20) moves
    # this model's fp8 gradients by 2-3% (measured, both recipes), and TP sums in another order
    # (7e-7 apart in fp32). SGD at a moderate rate keeps the two trajectories comparable; Adam's
    # normalised first steps would amplify those legitimate differences.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # q_norm / k_norm act per head inside the TP region: each rank sees its heads only, so their
    # gradients are partial sums (a TP fact, not an FP8 one) and are summed over the TP group.
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    losses = []
    for step in range(steps):
        ids, labels = batch(step, 0, batch_size=4, seq=128)  # every TP rank sees the same batch
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if tp:
            for p in head_norms:
                torch.distributed.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_stock_tp_styles_on_fp8_layers_match_one_process(recipe):
    steps = 20
    single = run_workers(_qwen_losses, 1, recipe, steps, False)[0]
    tp = run_workers(_qwen_losses, 2, recipe, steps, True)
    for losses in tp:
        t, s = torch.tensor(losses), torch.tensor(single)
        assert torch.isfinite(t).all()
        assert abs(losses[0] - single[0]) / single[0] < 1e-4  # same weights: only summation order differs
        assert ((t - s).abs() / s.abs()).max() < 1e-3, (losses[:4], single[:4])


@pytest.mark.parametrize("recipe,seq", [("tensorwise", 128), ("rowwise", 128), ("blockwise", 256)])
def test_sequence_parallel_qwen3_fp8_styles_match_stock_and_one_process(recipe, seq):
    """The whole model sequence-parallel (embedding, norms, attention, MLP, lm_head) at TP=2 for
    20 steps: the FP8 gathers give bitwise the stock bf16-gather run, which tracks one process."""
    steps = 20
    single = run_workers(_qwen_sp_losses, 1, recipe, steps, seq, True)[0]
    fp8 = run_workers(_qwen_sp_losses, 2, recipe, steps, seq, True)
    stock = run_workers(_qwen_sp_losses, 2, recipe, steps, seq, False)
    assert fp8[0] == fp8[1] == stock[0], (fp8[0][:4], stock[0][:4])
    t, s = torch.tensor(fp8[0]), torch.tensor(single)
    assert torch.isfinite(t).all()
    assert ((t - s).abs() / s.abs()).max() < 1e-3, (fp8[0][:4], single[:4])


class SwiGLU(nn.Module):
    def __init__(self, dim=128, hidden=256):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _colwise_into_rowwise(rank, world_size, recipe):
    """The case that gives NaN losses in torchtitan: colwise outputs kept as DTensors
    (use_local_output=False) feeding a row-wise FP8 layer, whose amax must be the full tensor's."""
    import fp8func._casts as casts_mod

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model, ref = SwiGLU(), SwiGLU()
    ref.load_state_dict(model.state_dict())
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    f8.convert(ref, recipe, fsdp_fp8_all_gather=False)
    parallelize_module(model, mesh, {"gate": ColwiseParallel(use_local_output=False),
                                     "up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    seen = []
    orig = casts_mod.quantize

    def recording(t, spec, **kw):
        q = orig(t, spec, **kw)
        if isinstance(t, DTensor):  # a sharded activation: its scales must be the full tensor's
            full = orig(t.full_tensor(), spec)
            # (gloo moves no fp8: compare the fp32 dequantized values, which pin the payload too)
            seen.append(torch.equal(q.scale.full_tensor(), full.scale)
                        and torch.equal(f8.dequantize(q, torch.float32).full_tensor(),
                                        f8.dequantize(full, torch.float32)))
        return q

    casts_mod.quantize = recording  # every cast the linear makes goes through _casts
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 128, generator=g) * 50  # large activations: a local amax would overflow
        y, y_ref = model(x), ref(x)
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
        y_ref.backward(dy)
    finally:
        casts_mod.quantize = orig
    grads_ok = all(torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
    close = (y - y_ref).abs().max().item() / y_ref.abs().max().item()
    wgrad = max((m.weight.grad.full_tensor() - r.weight.grad).abs().max().item() / r.weight.grad.abs().max().item()
                for m, r in ((model.gate, ref.gate), (model.up, ref.up), (model.down, ref.down)))
    return {"sharded_quantizations": len(seen), "all_global": all(seen), "finite": bool(torch.isfinite(y).all()),
            "grads_finite": bool(grads_ok), "rel_out": close, "rel_wgrad": wgrad}


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_colwise_dtensor_outputs_use_the_global_amax(recipe):
    for r in run_workers(_colwise_into_rowwise, 2, recipe):
        assert r["sharded_quantizations"] > 0 and r["all_global"], r
        assert r["finite"] and r["grads_finite"], r
        assert r["rel_out"] < 1e-5 and r["rel_wgrad"] < 1e-5, r


def _fsdp_tp(rank, world_size, recipe, fp8_gather, steps, sp):
    """FSDP2 over dp x TP over tp (2 x 2), or (world 1) the same model on one rank, same data.

    ``sp``: sequence parallel with the fp8func styles (FP8 all-gathers on both mesh dims: the
    weights over dp, the activations and grad_outputs over tp); else the stock TP styles."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    two_d = world_size == 4
    mesh = init_device_mesh("cpu", (2, 2) if two_d else (1,), mesh_dim_names=("dp", "tp") if two_d else ("dp",))
    dp_mesh = mesh["dp"]
    tp_mesh = mesh["tp"] if two_d else None  # sliced once: torch 2.13 builds a new mesh per mesh["tp"]
    model = tiny_qwen3()
    f8.convert(model, recipe, fsdp_fp8_all_gather=fp8_gather)
    if two_d and sp:
        model_plan, block_plan = qwen_sp_plans(fp8_styles=True)
        parallelize_module(model, tp_mesh, model_plan)
    for layer in model.model.layers if two_d else ():
        parallelize_module(layer, tp_mesh, block_plan if sp else QWEN_TP_PLAN)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sp_gathers, orig = [], tp_mod._gather_casts

    def counting(*args):
        sp_gathers.append(1)
        return orig(*args)

    tp_mod._gather_casts = counting
    with _CountAllGather() as fsdp_counter:
        losses = _fsdp_tp_steps(model, opt, mesh, head_norms, steps, two_d, sp)
    tp_mod._gather_casts = orig
    return {"losses": losses, "fsdp_bytes": fsdp_counter.bytes, "sp_gathers": len(sp_gathers)}


def _fsdp_tp_steps(model, opt, mesh, head_norms, steps, two_d, sp):
    dp_mesh = mesh["dp"]
    losses = []
    for step in range(steps):
        if two_d:
            ids, labels = batch(step, mesh.get_local_rank("dp"), batch_size=2, seq=128)
        else:  # both dp ranks' batches at once: the mean loss and gradient of the 2-D run
            parts = [batch(step, r, batch_size=2, seq=128) for r in range(2)]
            ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = sp_forward(model, ids, labels) if sp else model(input_ids=ids, labels=labels).loss
        loss.backward()
        if two_d:
            for p in head_norms:  # per-head norms inside the TP region: partial over tp
                torch.distributed.all_reduce(p.grad.to_local(), group=mesh["tp"].get_group())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if two_d:
            torch.distributed.all_reduce(mean, group=dp_mesh.get_group())
            mean /= 2
        losses.append(mean.item())
    return losses


@pytest.mark.parametrize("recipe,sp", [("tensorwise", True), ("rowwise", True), ("rowwise", False)],
                         ids=["tensorwise-sp-fp8-styles", "rowwise-sp-fp8-styles", "rowwise-stock-styles"])
def test_fsdp_x_tp_2d(recipe, sp):
    steps = 10
    on = run_workers(_fsdp_tp, 4, recipe, True, steps, sp)
    off = run_workers(_fsdp_tp, 4, recipe, False, steps, sp)
    single = run_workers(_fsdp_tp, 1, recipe, False, steps, sp)[0]["losses"]
    assert on[0]["losses"] == off[0]["losses"], "FSDP fp8 all-gather on/off must stay bitwise equal under 2D"
    # FP8 on both mesh dims: FSDP2 gathers fewer weight bytes over dp (exact counts: test_fsdp.py);
    # over tp, per step and rank, each block's attention and MLP inputs (forward) and o_proj's
    # and down_proj's grad_outputs (backward) travel as fp8 casts, plus lm_head's input.
    assert on[0]["fsdp_bytes"] < 0.6 * off[0]["fsdp_bytes"], (on[0]["fsdp_bytes"], off[0]["fsdp_bytes"])
    assert on[0]["sp_gathers"] == (steps * (4 * 2 + 1) if sp else 0), on[0]["sp_gathers"]
    t, s = torch.tensor(on[0]["losses"]), torch.tensor(single)
    assert torch.isfinite(t).all()
    assert ((t - s).abs() / s.abs()).max() < 1e-3, (on[0]["losses"][:4], single[:4])


def _sp_mlp(rank, world_size, recipe, fp8_styles, compiled=False, local_output=True, batch=2):
    """Sequence-parallel SwiGLU: input and output sharded along the sequence (Shard(1)).

    ``local_output=False``: every style hands on DTensors (``use_local_output=False``)."""
    from torch.distributed.tensor import Shard

    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    # hidden 128 per rank: whole 128 x 128 weight blocks on every rank (blockwise)
    model = f8.convert(SwiGLU(hidden=128 * world_size), recipe, fsdp_fp8_all_gather=False)
    col, row = (Fp8ColwiseParallel, Fp8RowwiseParallel) if fp8_styles else (ColwiseParallel, RowwiseParallel)
    kw = {"use_local_output": local_output}
    parallelize_module(model, mesh, {"gate": col(input_layouts=Shard(1), **kw), "up": col(input_layouts=Shard(1), **kw),
                                     "down": row(output_layouts=Shard(1), **kw)})
    forward = torch.compile(model, fullgraph=True) if compiled else model  # fullgraph: no graph break
    gathers = []
    orig = tp_mod._gather_casts

    def counting(x_local, mesh, specs, *args):
        gathers.append([name for name, _ in specs])
        return orig(x_local, mesh, specs, *args)

    tp_mod._gather_casts = counting
    import fp8func._collectives as coll

    collectives, orig_all_gather, orig_gather_rows = [], coll._all_gather, tp_mod.gather_rows

    def counting_all_gather(t, group):
        collectives.append(tuple(t.shape))
        return orig_all_gather(t, group)

    def counting_gather_rows(t, mesh, mesh_dim):
        collectives.append(tuple(t.shape))
        return orig_gather_rows(t, mesh, mesh_dim)

    coll._all_gather, tp_mod.gather_rows = counting_all_gather, counting_gather_rows
    g = torch.Generator().manual_seed(1)
    seq = 128 * world_size  # whole 128-token blocks per rank: blockwise gathers in fp8 too
    x_full = torch.randn(batch, seq, 128, generator=g) * 3
    dy_full = torch.randn(batch, seq, 128, generator=g)
    x = x_full.chunk(world_size, dim=1)[rank].clone().requires_grad_()
    y = forward(x)
    dy = dy_full.chunk(world_size, dim=1)[rank]
    if not local_output:
        assert isinstance(y, DTensor) and y.placements == (Shard(1),), y
        dy = DTensor.from_local(dy, mesh, [Shard(1)])
    y.backward(dy)
    y = y.to_local() if isinstance(y, DTensor) else y
    tp_mod._gather_casts, coll._all_gather, tp_mod.gather_rows = orig, orig_all_gather, orig_gather_rows
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # clone(): the stock style returns an AsyncCollectiveTensor; a compute op waits for it.
    return {"y": y.detach().clone(), "dx": x.grad.clone(), "grads": grads,
            "gathers": [names[0] for names in gathers], "all_gathers": collectives}


@pytest.mark.parametrize("recipe,world_size", [("tensorwise", 2), ("rowwise", 2), ("blockwise", 2),
                                               ("rowwise_with_gw_hp", 2), ("rowwise", 4), ("blockwise", 4),
                                               ("tensorwise", 1), ("rowwise", 1)])
def test_fp8_sequence_parallel_gather_is_bitwise_the_bf16_gather_then_cast(recipe, world_size):
    fp8 = run_workers(_sp_mlp, world_size, recipe, True)
    stock = run_workers(_sp_mlp, world_size, recipe, False)
    # gate's and up's inputs, then down's grad_output, gathered in fp8; rowwise_with_gw_hp needs
    # the high-precision input and grad_output for its grad_weight GEMM, so it gathers in bf16.
    assert fp8[0]["gathers"] == ([] if recipe == "rowwise_with_gw_hp" else ["x", "x", "dy"]), fp8[0]["gathers"]
    # One all-gather per FP8 gather (the casts and their scales in one buffer); on a one-rank TP
    # group none: the gathered casts are the rank's own.
    assert len(fp8[0]["all_gathers"]) == (0 if world_size == 1 else len(fp8[0]["gathers"])), fp8[0]["all_gathers"]
    for a, b in zip(fp8, stock):
        assert torch.equal(a["y"], b["y"])
        assert torch.equal(a["dx"], b["dx"])
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_sequence_parallel_gather_of_one_sequence_is_bitwise_the_bf16_gather_then_cast(recipe, compiled):
    """Batch 1: a tensorwise cast's rows are gathered as they are (the graph async TP fuses), the
    row-wise casts through the packed buffer; both bitwise the stock styles, one all-gather each."""
    fp8 = run_workers(_sp_mlp, 2, recipe, True, compiled, True, 1)
    stock = run_workers(_sp_mlp, 2, recipe, False, compiled, True, 1)
    assert {"x", "dy"} <= set(fp8[0]["gathers"]), fp8[0]["gathers"]
    if not compiled:  # compiled code runs no Python: the counting wrappers see the traced calls only
        assert len(fp8[0]["all_gathers"]) == 3, fp8[0]["all_gathers"]
        if recipe == "tensorwise":  # the fp8 rows themselves, [S/tp, F] bytes
            assert fp8[0]["all_gathers"] == [(128, 128)] * 3, fp8[0]["all_gathers"]
    for a, b in zip(fp8, stock):
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["dx"], b["dx"])
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


def _async_tp_matches(rank, world_size):
    """Inductor's micro-pipeline TP pattern search (what async TP fuses) over the compiled forward
    and backward of the sequence-parallel SwiGLU, tensorwise on the hardware GEMM, as NCCL would
    run it (fp8 payloads moved as fp8): per graph, for each all-gather found, the type of the
    all-gathered operand and the matmuls it would fuse with. A fake two-rank process group stands
    in for NCCL (gloo has no fp8 dtypes): the graphs compile, nothing is communicated."""
    import tempfile

    import torch._inductor.fx_passes.micro_pipeline_tp as mp
    import torch._inductor.fx_passes.post_grad as post_grad
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fp8func._collectives as coll

    found = []

    def probe(graph):
        found.append([(str(mp._get_tensor(ag.shard_node).dtype),
                       [type(m).__name__ for m in mp._find_consumer_matmuls(ag.res_node)])
                      for ag in mp.find_all_gather_patterns(graph)])

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    orig_pass, orig_moves = post_grad.micro_pipeline_tp_pass, coll.moves_fp8
    post_grad.micro_pipeline_tp_pass, coll.moves_fp8 = probe, lambda t: True
    try:
        with torch._inductor.config.patch(_micro_pipeline_tp=True, fx_graph_cache=False):
            _sp_mlp(0, 2, f8.Recipe.from_name("tensorwise", path="hardware"), True, True, True, 1)
    finally:
        post_grad.micro_pipeline_tp_pass, coll.moves_fp8 = orig_pass, orig_moves
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
    return found


def test_fp8_sequence_gathers_are_the_pattern_async_tp_fuses():
    """Each FP8 sequence gather of one sequence (gate's and up's input in the forward, one gather
    once the compiler merged the two identical ones; down's grad_output in the backward) reaches
    its GEMMs as all_gather (fp8) -> wait -> _scaled_mm, which inductor's async-TP pass fuses into a
    pipelined all-gather-matmul (``torch.ops.symm_mem.fused_all_gather_scaled_matmul``, handed the
    gathered operand's shard: fp8, not its bytes)."""
    import torch._inductor.fx_passes.micro_pipeline_tp as mp

    if not hasattr(mp, "find_all_gather_patterns") or not hasattr(mp, "_find_consumer_matmuls"):
        pytest.skip("this torch's micro-pipeline TP pass has another structure")
    forward, backward = run_workers(_async_tp_matches, 1)[0]
    assert forward == [("torch.float8_e4m3fn", ["_ScaledMatmul", "_ScaledMatmul"])], forward
    assert backward == [("torch.float8_e5m2", ["_ScaledMatmul"])], backward


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_sequence_parallel_styles_with_dtensor_outputs(recipe):
    """use_local_output=False on every style: DTensors flow between the layers, same bits."""
    fp8 = run_workers(_sp_mlp, 2, recipe, True, False, False)
    stock = run_workers(_sp_mlp, 2, recipe, False, False, False)
    assert fp8[0]["gathers"] == ["x", "x", "dy"], fp8[0]["gathers"]
    for a, b in zip(fp8, stock):
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["dx"], b["dx"])
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_sequence_parallel_styles_under_torch_compile(recipe):
    """Compiled with fullgraph=True (no graph break): the FP8 gathers of the inputs and of the
    grad_output run inside the graph, bitwise the compiled stock styles and the eager FP8 styles."""
    fp8 = run_workers(_sp_mlp, 2, recipe, True, True)
    stock = run_workers(_sp_mlp, 2, recipe, False, True)
    eager = run_workers(_sp_mlp, 2, recipe, True, False)
    assert {"x", "dy"} <= set(fp8[0]["gathers"]), fp8[0]["gathers"]  # traced (the compiled code runs no Python)
    for a, b, c in zip(fp8, stock, eager):
        assert torch.equal(a["y"], c["y"]) and torch.equal(a["dx"], c["dx"])
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["dx"], b["dx"])
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name
            assert torch.equal(a["grads"][name], c["grads"][name]), name


def _refuse_plain(rank, world_size):
    from fp8func.distributed import Fp8ColwiseParallel

    mesh = init_device_mesh("cpu", (world_size,))
    try:
        parallelize_module(SwiGLU(), mesh, {"gate": Fp8ColwiseParallel()})
    except TypeError as e:
        return str(e)
    return "no error"


def test_fp8_styles_refuse_plain_linear():
    assert "applies to fp8func.nn.Fp8Linear, got Linear; run fp8func.convert" in run_workers(_refuse_plain, 2)[0]


def _split_blocks(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = f8.convert(SwiGLU(dim=128, hidden=128), "blockwise", fsdp_fp8_all_gather=False)
    parallelize_module(model, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        model(torch.randn(128, 128))
    except ValueError as e:
        return str(e)
    return "no error"


def test_blockwise_weight_blocks_split_by_tp_raise_a_clear_error():
    """hidden 128 over TP=2: 64 rows per rank split each 128 x 128 weight block between two ranks."""
    msg = run_workers(_split_blocks, 2)[0]
    assert "the local size 64 is not a multiple of block 128, so a block straddles two ranks" in msg, msg
    assert "tensor parallel: a degree that leaves each shard a multiple of it" in msg, msg


class QKV(nn.Module):
    """Three projections reading one input (an attention block's q, k, v) and an output one."""

    def __init__(self, dim=128):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))


def _sp_qkv(rank, world_size, recipe, fp8_styles):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = f8.convert(QKV(), recipe, fsdp_fp8_all_gather=False)
    prep, col, row = ((PrepareFp8ModuleInput, Fp8ColwiseParallel, Fp8RowwiseParallel) if fp8_styles
                      else (PrepareModuleInput, ColwiseParallel, RowwiseParallel))
    parallelize_module(model, mesh, {"": prep(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                                     "q": col(), "k": col(), "v": col(), "o": row(output_layouts=Shard(1))})
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 256, 128, generator=g) * 2).chunk(world_size, dim=1)[rank].clone().requires_grad_()
    y = model(x)
    y.backward(torch.randn(2, 256, 128, generator=g).chunk(world_size, dim=1)[rank])
    return {"y": y.detach().clone(), "dx": x.grad.clone(),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_prepare_fp8_module_input_gathers_once_for_q_k_v(recipe):
    fp8 = run_workers(_sp_qkv, 2, recipe, True)
    stock = run_workers(_sp_qkv, 2, recipe, False)
    for a, b in zip(fp8, stock):
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["dx"], b["dx"])
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


def _delayed_tp_compiled(rank, world_size, hook):
    """A delayed-scaling MLP under the stock TP styles, eager and compiled (fullgraph), 3 steps:
    the scaling states of each run (replicated DTensors after parallelize_module), or the error."""
    mesh = init_device_mesh("cpu", (world_size,))
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
        f8.convert(model, "delayed", fsdp_fp8_all_gather=False)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        if hook:
            assert f8.nn.hook_scaling_states(model) == 2
        run = torch.compile(model, fullgraph=True) if compiled else model
        try:
            for step in range(3):
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (step + 1)
                run(x).sum().backward()
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            return str(e)
        runs.append([b.full_tensor().clone() for b in model.buffers()])
    return runs


@pytest.mark.slow
def test_delayed_scaling_under_tp_compiles_once_its_new_buffers_are_hooked():
    for eager, compiled in run_workers(_delayed_tp_compiled, 2, True):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
        assert eager[1].flatten().ne(eager[1].new_ones(1)).all()  # the input scale moved off its initial value
    for out in run_workers(_delayed_tp_compiled, 2, False):  # parallelize_module replaced the buffers
        assert isinstance(out, str) and "fp8func.nn.hook_scaling_states(model)" in out, out


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
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
