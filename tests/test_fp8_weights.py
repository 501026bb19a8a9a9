"""FP8 primary weights: ``convert(..., fp8_weights=True)`` + ``MasterWeights``.

The contract: an fp32-built model trained with fp8 weights and fp32 masters gives, at every step,
bitwise the losses of the same model trained with the fp8 all-gather of fp32 weights (both
quantize ``master.to(bf16)`` with the mesh-reduced amax), moves the same all-gather bytes, and keeps
1 byte per weight element (tensorwise) instead of 4. Plus: the ops FSDP2 / init / loading apply
keep the type, writes are staged (never quantized with a local amax), meta-device init works.
"""

import copy
import io

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8
from fp8func.distributed import Fp8WeightParam

from .dist_harness import run_workers
from .models import batch, tiny_qwen3
from .test_fsdp import _CountAllGather

TENSORWISE = f8.Recipe.from_name("tensorwise")


def _fp8_weights(model):
    return [(fqn, p) for fqn, p in model.named_parameters()
            if isinstance(p._local_tensor if hasattr(p, "_local_tensor") else p, Fp8WeightParam)]


# ---- the tensor type, single process ------------------------------------------------------------

def test_structural_ops_keep_the_type_and_split_payloads_with_the_rows():
    hp = torch.randn(256, 128)
    w = Fp8WeightParam(hp, f8.Recipe.from_name("rowwise"))
    assert w.is_staged and torch.equal(w.dequantize(), hp)  # nothing quantized before first use
    casts = w.casts()  # outside FSDP2: quantized now with the whole tensor's amax
    assert not w.is_staged and sorted(casts) == ["w", "w_t"]
    assert w.storage_bytes() == 2 * hp.numel() + 256 * 4 + 128 * 4  # two payloads: 2 bytes/element
    top, bottom = torch.chunk(w, 2)  # FSDP2's split
    assert type(top) is Fp8WeightParam and top.shape == (128, 128)
    assert top._state.casts["w"].scale.shape == (128, 1)  # row scales follow the rows
    assert top._state.casts["w_t"].scale is casts["w_t"].scale  # column scales span them: carried
    padded = w.new_zeros((130, 128))  # FSDP2's padded shard, then a copy into its first rows
    padded.narrow(0, 0, 128).copy_(bottom)
    assert torch.equal(padded.narrow(0, 0, 128).dequantize(), w.dequantize()[128:])
    assert type(w.detach()) is Fp8WeightParam and type(w.clone()) is Fp8WeightParam
    twin = copy.deepcopy(nn.Parameter(w))
    assert type(twin) is Fp8WeightParam and twin._state is not w._state
    assert torch.equal(twin.dequantize(), w.dequantize())
    assert type(w.to(torch.bfloat16)) is Fp8WeightParam and w.to(torch.bfloat16).dtype == torch.bfloat16
    assert type(torch.empty_like(w, device="meta")) is Fp8WeightParam
    assert type(w * 2) is torch.Tensor and torch.equal(w * 2, w.dequantize() * 2)  # other ops: values
    flat = padded.view(-1)  # FSDP2 keeps this and never reads it: a shell, holding no values
    assert flat.shape == (130 * 128,) and flat.storage_bytes() == 0
    with pytest.raises(RuntimeError, match="flattened view of an Fp8WeightParam"):
        flat + 1


def test_writes_are_staged_through_aliases_and_never_quantized_locally():
    w = nn.Parameter(Fp8WeightParam(torch.randn(128, 64), TENSORWISE))
    w.casts()
    assert not w.is_staged
    with torch.no_grad():
        w.data.normal_()  # HF / nn.init style: through .data, an alias sharing the state
    assert w.is_staged and w._state.casts is None
    with torch.no_grad():
        w.copy_(torch.ones(128, 64))  # load_state_dict style: a copy from a plain tensor
        w.mul_(3)
    assert torch.equal(w.dequantize(), torch.full((128, 64), 3.0))
    with torch.no_grad():
        w.copy_(torch.randn(128, 64))
    before = w.casts()["w"].data.clone()
    opt = torch.optim.AdamW([w], lr=0.1)  # an optimizer directly on the fp8 weight updates it too
    w.grad = torch.randn(128, 64)
    opt.step()
    assert w.is_staged and not torch.equal(w.casts()["w"].data, before)


def test_pickle_is_the_plain_values_and_errors_name_the_fix():
    w = Fp8WeightParam(torch.randn(128, 64), TENSORWISE)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w.dequantize())
    with pytest.raises(NotImplementedError, match="along dim 1 .*fp8_weights=False"):
        w.split(32, dim=1)
    block = Fp8WeightParam(torch.randn(256, 128), f8.Recipe.from_name("blockwise"))
    block.casts()
    with pytest.raises(ValueError, match="one scale per 128 rows.*rows 0:100"):
        block[:100]
    with pytest.raises(ValueError, match="delayed scaling.*fp8_weights=False"):
        f8.convert(tiny_qwen3(layers=1), "delayed", fp8_weights=True)
    with pytest.raises(ValueError, match="implies the fp8 all-gather"):
        f8.convert(tiny_qwen3(layers=1), "tensorwise", fp8_weights=True, fsdp_fp8_all_gather=False)


def test_convert_report_and_tied_weights():
    model = tiny_qwen3(layers=1)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: stays high precision
    f8.convert(model, "tensorwise", fp8_weights=True)
    rows = {r.fqn: r for r in f8.report(model, print_table=False)}
    assert rows["model.layers.0.mlp.up_proj"].fp8_weights
    assert not rows["lm_head"].fp8_weights and "stays high precision" in rows["lm_head"].reason
    assert "fp8 weights" in str(f8.report(model, print_table=False))
    assert type(model.lm_head.weight) is nn.Parameter


def _train_single(recipe, fp8_weights, steps=3):
    model = tiny_qwen3(layers=1)
    if fp8_weights:
        f8.convert(model, recipe, fp8_weights=True)
        trained = f8.nn.MasterWeights(model)
    else:
        trained = f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    losses, payloads = [], []
    for step in range(steps):
        ids, labels = batch(step, 0)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if fp8_weights:
            trained.step(opt)
            payloads.append(model.model.layers[0].mlp.up_proj.weight._state.casts["w"].data.clone())
        else:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, payloads, model


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8", "rowwise_with_gw_hp"])
def test_without_fsdp_bitwise_the_fp32_weight_model(recipe):
    # No mesh: the weights are re-quantized with their own amax, no collective.
    ref, _, _ = _train_single(recipe, False)
    losses, payloads, model = _train_single(recipe, True)
    assert losses == ref
    assert not torch.equal(payloads[0], payloads[1]) and not torch.equal(payloads[1], payloads[2])
    assert all(w.sharding == () for _, w in _fp8_weights(model))


def test_state_dict_round_trip_stages_the_values():
    a = f8.convert(tiny_qwen3(layers=1), "tensorwise", fp8_weights=True)
    ids, labels = batch(0, 0)
    sd = a.state_dict()
    w = a.model.layers[0].mlp.up_proj.weight
    assert type(sd["model.layers.0.mlp.up_proj.weight"]) is torch.Tensor  # the plain values, as nn.Linear's
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], w.dequantize())
    b = f8.convert(tiny_qwen3(layers=1, seed=1), "tensorwise", fp8_weights=True)
    b.load_state_dict(sd)
    assert b.model.layers[0].mlp.up_proj.weight.is_staged
    assert torch.equal(b(input_ids=ids, labels=labels).loss, a(input_ids=ids, labels=labels).loss)


def test_memory_bench_logic_on_cpu():
    # The GPU benchmark's measurement (python -m fp8func.bench memory) on a tiny Llama, counting storages.
    from fp8func.bench import _memory

    tiny = dict(_memory.LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512,
                num_attention_heads=4, num_key_value_heads=4)
    rows = {r["weights"]: r for r in _memory.run(recipes=("tensorwise", "rowwise"), config=tiny, device="cpu")}
    bf16, tw, rw = rows["bf16"], rows["fp8 tensorwise"], rows["fp8 rowwise"]
    linear = 2 * (4 * 256 * 256 + 3 * 256 * 512) + 512 * 256  # the converted weights: 2 layers + lm_head
    scales = 15 * 4  # one fp32 scale each
    assert tw["param_bytes"] == bf16["param_bytes"] - 2 * linear + linear + scales  # 1 byte/element, not 2
    assert rw["param_bytes"] > bf16["param_bytes"]  # two payloads (2 bytes/element) and row/column scales
    assert "| fp8 tensorwise |" in _memory.table(list(rows.values()))


# ---- FSDP2, 2 processes -----------------------------------------------------------------------

def _train(rank, world_size, recipe, mode, steps, reshard=True, weights="fp32-master", meta=False):
    """mode: "hp" (no FP8), "gather" (fp8 all-gather of hp weights), "weights" (fp8 weights)."""
    import fp8func.nn._master as master_mod

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta" if meta else "cpu"):
        model = tiny_qwen3()
    if weights == "bf16-weights":
        model, mp = model.bfloat16(), MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mode != "hp":
        f8.convert(model, recipe, fp8_weights=mode == "weights")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    init = None
    if meta:  # materialise the shards, then initialise them (DTensor random ops, per shard)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(model._init_weights)
        local = model.model.layers[0].mlp.up_proj.weight._local_tensor
        init = (local.dequantize() if mode == "weights" else local._tensor).clone()
    trained = f8.nn.MasterWeights(model, dtype=model.dtype) if mode == "weights" else model
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    reductions = []
    orig = master_mod.reduce_amax
    master_mod.reduce_amax = lambda *a: reductions.append(1) or orig(*a)
    losses, payloads = [], []
    with _CountAllGather() as counter:
        for step in range(steps):
            ids, labels = batch(step, rank)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            if mode == "weights":
                trained.step(opt)
                payloads.append(model.model.layers[0].mlp.up_proj.weight._local_tensor._state.casts["w"].data.clone())
            else:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    master_mod.reduce_amax = orig
    locals_ = [p._local_tensor for _, p in _fp8_weights(model)]
    return {"losses": losses, "bytes": counter.bytes, "payloads": payloads, "reductions": len(reductions), "init": init,
            "staged": any(w.is_staged for w in locals_), "numel": sum(w.numel() for w in locals_),
            "payload_bytes": sum(q.data.untyped_storage().nbytes() for w in locals_ for q in w._state.casts.values()),
            "scale_bytes": sum(q.scale.untyped_storage().nbytes() for w in locals_ for q in w._state.casts.values())}


def _train_modes(rank, world_size, modes, *args):
    """``_train`` for each mode in turn, in the same processes (one spawn: it is the slow part)."""
    return {mode: _train(rank, world_size, recipe, mode, *args) for mode, recipe in modes}


# On this tiny Qwen3 (2 ranks, 20 steps, AdamW lr 3e-3) the largest relative gap to the bf16 run at
# any step is 4.0e-3 (tensorwise), 3.5e-3 (rowwise), 4.1e-3 (blockwise).
TRACKING_RTOL = 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("recipe,payloads", [("tensorwise", 1), ("rowwise", 2), ("blockwise", 1)])
def test_fsdp_fp8_weights_bitwise_the_fp8_all_gather(recipe, payloads):
    steps = 20
    modes = [("weights", recipe), ("gather", recipe), ("hp", None)]
    results = run_workers(_train_modes, 2, modes, steps)
    for r in results:
        assert r["weights"]["losses"] == r["gather"]["losses"], (r["weights"]["losses"][:3], r["gather"]["losses"][:3])
        assert r["weights"]["bytes"] == r["gather"]["bytes"]  # the same fp8 payloads travel
    r = results[0]["weights"]
    # The weights really change at every step, and the shards hold only fp8 payloads + scales.
    assert all(not torch.equal(a, b) for a, b in zip(r["payloads"], r["payloads"][1:]))
    assert not r["staged"] and r["payload_bytes"] == payloads * r["numel"], (r["payload_bytes"], r["numel"])
    if recipe == "tensorwise":
        assert r["scale_bytes"] == 4 * 15  # one fp32 scale per weight: 2 layers x 7 projections + lm_head
    # ... and tracks the bf16 run (no FP8 at all, fp32 masters too) within TRACKING_RTOL at every step.
    hp = results[0]["hp"]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], hp))
    assert rel < TRACKING_RTOL, rel
    # One amax all-reduce per step for the whole model (tensorwise scales; row-wise column scales);
    # 128x128 blocks lie inside each shard: none.
    assert r["reductions"] == {"tensorwise": steps, "rowwise": steps, "blockwise": 0}[recipe]


@pytest.mark.slow
def test_fsdp_bf16_weights_no_reshard_rowwise():
    # A bf16-built model with bf16 masters: bitwise the fp8 all-gather of bf16 weights (AdamW on
    # bf16 either way); no reshard after forward, so both row-wise casts travel in the forward.
    r = run_workers(_train_modes, 2, [("weights", "rowwise"), ("gather", "rowwise")], 4, False, "bf16-weights")[0]
    assert r["weights"]["losses"] == r["gather"]["losses"] and r["weights"]["bytes"] == r["gather"]["bytes"]


@pytest.mark.slow
def test_meta_device_init_is_bitwise_the_high_precision_init():
    # fully_shard on meta, to_empty, init. 3 ranks: 256-row weights shard as 86/86/84 rows, so
    # FSDP2 pads (new_zeros, narrow, copy_) the staged values.
    results = run_workers(_train_modes, 3, [("weights", "rowwise"), ("gather", "rowwise")], 3, True, "fp32-master",
                          True)
    for r in results:
        assert torch.equal(r["weights"]["init"], r["gather"]["init"])  # staged: exactly the hp init
        assert r["weights"]["losses"] == r["gather"]["losses"]


# ---- faults are never hidden: gradients on the optimizer's parameters, loads reach the masters ---

def _fp8_model_and_masters(seed=0):
    model = f8.convert(tiny_qwen3(layers=1, seed=seed), "tensorwise", fp8_weights=True)
    return model, f8.nn.MasterWeights(model)


def test_gradients_land_on_the_masters_at_backward():
    ref = f8.convert(tiny_qwen3(layers=1), "tensorwise", fsdp_fp8_all_gather=False)  # same numbers, fp32 weights
    model, masters = _fp8_model_and_masters()
    ids, labels = batch(0, 0)
    for m in (ref, model):
        m(input_ids=ids, labels=labels).loss.backward()
    # Every gradient the next step uses is on the optimizer's parameters, none left on the fp8 weights.
    assert all(p.grad is None for _, p in _fp8_weights(model))
    assert all(p.grad is not None for p in masters.parameters())
    norm = torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))  # the whole norm, bitwise


def test_a_nan_gradient_shows_on_the_masters_and_zero_grad_drops_it():
    model, masters = _fp8_model_and_masters()
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)
    ids, labels = batch(0, 0)
    loss = model(input_ids=ids, labels=labels).loss
    (loss * float("nan")).backward()  # a bad step (an overflowed loss scale, a bad batch)
    assert torch.isnan(torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0))  # the check sees it
    opt.zero_grad()  # skip the step, as GradScaler or a NaN guard does
    model(input_ids=ids, labels=labels).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in masters.parameters())  # nothing carried into this one
    masters.step(opt)
    assert all(torch.isfinite(p).all() for p in masters.parameters())


def test_loading_a_model_state_dict_updates_the_masters():
    """Resume from ``model.state_dict()`` (what HF save_pretrained / Trainer store): the masters take
    the loaded values, and training goes on bitwise as the uninterrupted run."""
    def steps(model, masters, opt, first, last):
        out = []
        for step in range(first, last):
            ids, labels = batch(step, 0)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            masters.step(opt)
            out.append(loss.item())
        return out

    model, masters = _fp8_model_and_masters()
    opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    straight = steps(model, masters, opt, 0, 4)
    model, masters = _fp8_model_and_masters()
    opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    first = steps(model, masters, opt, 0, 2)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model, masters = _fp8_model_and_masters(seed=1)  # a fresh process: other initial weights
    opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    model.load_state_dict(sd)
    key = "model__layers__0__mlp__up_proj__weight"
    assert torch.equal(getattr(masters, key), sd["model.layers.0.mlp.up_proj.weight"])
    assert first + steps(model, masters, opt, 2, 4) == straight
    with pytest.raises(ValueError, match="already has a master"):
        f8.nn.MasterWeights(model)


def _fsdp_grad_norms(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for mode in ("gather", "weights"):
        model = f8.convert(tiny_qwen3(), "tensorwise", fp8_weights=mode == "weights")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        trained = f8.nn.MasterWeights(model) if mode == "weights" else model
        ids, labels = batch(0, rank)
        model(input_ids=ids, labels=labels).loss.backward()
        out[mode] = torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0).full_tensor()
        if mode == "weights":
            out["left_on_fp8_weights"] = sum(p.grad is not None for _, p in _fp8_weights(model))
            out["missing_on_masters"] = sum(p.grad is None for p in trained.parameters())
    return out


@pytest.mark.slow
def test_fsdp_gradients_land_on_the_masters():
    # FSDP2 calls the hook after its reduce-scatter: the masters hold the whole gradient, and its
    # norm is bitwise the fp8 all-gather model's (the same reduce-scattered gradients).
    for r in run_workers(_fsdp_grad_norms, 2):
        assert r["left_on_fp8_weights"] == 0 and r["missing_on_masters"] == 0
        assert torch.equal(r["weights"], r["gather"]), (r["weights"], r["gather"])
