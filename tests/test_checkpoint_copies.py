"""What training runs do to a converted model, for every convert option: HF ``save_pretrained`` /
``from_pretrained``, safetensors, ``torch.save`` / ``torch.load`` (``weights_only`` where it
applies), ``copy.deepcopy``, ``AveragedModel`` (EMA), and the structural-op table the weight types
share. Each check compares values (weights, and losses bitwise where the model is the same).

DCP under FSDP2 is in tests/test_checkpoint.py, the HF Trainer's checkpoint and resume in
tests/test_hf_trainer.py.
"""

import copy
import io

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fp8func as f8
from fp8func._structural import STRUCTURAL_OPS
from fp8func.distributed import Fp8AllGatherWeight, Fp8WeightParam
from fp8func.distributed._fp8_weights_ops import HANDLERS

from .models import batch

# convert options: (recipe, kwargs)
OPTIONS = {
    "defaults": ("tensorwise", {}),
    "rowwise": ("rowwise", {}),
    "no_fp8_all_gather": ("tensorwise", {"fsdp_fp8_all_gather": False}),
    "fp8_weights": ("tensorwise", {"fp8_weights": True}),
    "delayed": ("delayed", {}),
}
WEIGHT = "model.layers.0.mlp.up_proj.weight"


def _tiny(seed=0):
    from .models import tiny_qwen3

    return tiny_qwen3(hidden=64, intermediate=128, layers=1, heads=4, seed=seed)


def _trained(option, steps=2):
    """A converted tiny Qwen3 after ``steps`` optimizer steps (fp8 weights: through MasterWeights),
    so that weights, fp8 payloads and delayed-scaling state have all moved from their init."""
    recipe, kwargs = OPTIONS[option]
    model = f8.convert(_tiny(), recipe, **kwargs)
    masters = f8.nn.MasterWeights(model) if kwargs.get("fp8_weights") else None
    opt = torch.optim.AdamW((masters or model).parameters(), lr=1e-2)
    for step in range(steps):
        _step(model, masters, opt, step)
    return model, masters


def _step(model, masters, opt, step):
    ids, labels = batch(step, 0, seq=16)
    model(input_ids=ids, labels=labels).loss.backward()
    if masters is not None:
        masters.step(opt)
    else:
        opt.step()
        opt.zero_grad()


def _loss(model, step=7):
    ids, labels = batch(step, 0, seq=16)
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss


def _hp(model) -> dict[str, torch.Tensor]:
    """The model's state_dict as plain tensors (what a checkpoint of it must hold)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_kinds(a, b):
    def kinds(m):
        return [(n, type(p), p.requires_grad, isinstance(p, nn.Parameter)) for n, p in m.named_parameters()]

    assert kinds(a) == kinds(b)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_state_dict_holds_plain_high_precision_values(option):
    model, masters = _trained(option)
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values()), {k: type(v) for k, v in sd.items()}
    w = model.model.layers[0].mlp.up_proj.weight
    if option == "fp8_weights":  # the master's values: what the optimizer trains
        assert torch.equal(sd[WEIGHT], masters.model__layers__0__mlp__up_proj__weight)
        assert not torch.equal(sd[WEIGHT], w.dequantize())  # (not the fp8 weight's rounded values)
    elif type(w) is Fp8AllGatherWeight:  # the very tensor it wraps (shared storage, as nn.Linear's is)
        assert sd[WEIGHT].data_ptr() == w.hp_values().data_ptr() and torch.equal(sd[WEIGHT], w.hp_values())
    else:
        assert sd[WEIGHT].data_ptr() == w.data_ptr()
    assert ("model.layers.0.mlp.up_proj.fp8_x_history" in sd) == (option == "delayed")
    assert model.state_dict(keep_vars=True)[WEIGHT] is w  # keep_vars: the parameters themselves


@pytest.mark.parametrize("option", list(OPTIONS))
def test_save_pretrained_from_pretrained_plain_and_converted(option, tmp_path):
    from transformers import Qwen3ForCausalLM

    model, _ = _trained(option)
    expected = _hp(model)
    model.save_pretrained(tmp_path)
    plain = Qwen3ForCausalLM.from_pretrained(tmp_path)  # the checkpoint of an ordinary model
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k
    recipe, kwargs = OPTIONS[option]
    again = f8.convert(Qwen3ForCausalLM.from_pretrained(tmp_path), recipe, **kwargs)
    if option == "delayed":  # the scaling state is in the checkpoint too (the HF model has no such keys)
        again.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for k, v in again.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(_loss(again), _loss(model))  # the same converted model, bitwise
    _same_kinds(again, model)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_safetensors_round_trip(option, tmp_path):
    model, _ = _trained(option)
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    recipe, kwargs = OPTIONS[option]
    fresh = f8.convert(_tiny(seed=1), recipe, **kwargs)
    fresh.load_state_dict(loaded)
    assert torch.equal(_loss(fresh), _loss(model))
    _same_kinds(fresh, model)
    plain = _tiny(seed=1)
    plain.load_state_dict(loaded, strict=option != "delayed")  # delayed: its state buffers are extra keys
    assert torch.equal(plain.state_dict()[WEIGHT], model.state_dict()[WEIGHT])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_torch_save_model_restores_trainable_parameters(option):
    model, _ = _trained(option)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _same_kinds(loaded, model)  # nn.Parameters of the same types, requires_grad as before
    assert torch.equal(_loss(loaded), _loss(model))
    # An optimizer built after the load trains every weight (fp8 weights: through MasterWeights).
    masters = f8.nn.MasterWeights(loaded) if OPTIONS[option][1].get("fp8_weights") else None
    before = loaded.state_dict()[WEIGHT].clone()
    _step(loaded, masters, torch.optim.SGD((masters or loaded).parameters(), lr=0.1), 0)
    assert not torch.equal(loaded.state_dict()[WEIGHT], before)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_torch_save_state_dict_loads_weights_only(option):
    model, _ = _trained(option)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)  # plain tensors: no fp8func needed to read them
    recipe, kwargs = OPTIONS[option]
    fresh = f8.convert(_tiny(seed=1), recipe, **kwargs)
    fresh.load_state_dict(sd)
    assert torch.equal(_loss(fresh), _loss(model))
    buf = io.BytesIO()
    weight = model.model.layers[0].mlp.up_proj.weight
    torch.save(weight, buf)  # a weight alone: an nn.Parameter of its own values (fp8 weights: dequantized)
    buf.seek(0)
    w = torch.load(buf, weights_only=True)
    want = weight.dequantize() if option == "fp8_weights" else model.state_dict()[WEIGHT]
    assert type(w) is nn.Parameter and w.requires_grad and torch.equal(w, want)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_deepcopy_is_an_independent_model(option):
    model, _ = _trained(option)
    twin = copy.deepcopy(model)
    _same_kinds(twin, model)
    assert torch.equal(_loss(twin), _loss(model))
    before = _hp(model)
    masters = f8.nn.MasterWeights(twin) if option == "fp8_weights" else None
    opt = torch.optim.SGD((masters or twin).parameters(), lr=0.1)
    for step in range(2):  # training the copy leaves the original alone
        _step(twin, masters, opt, step)
    after = _hp(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    changed = _hp(twin)
    assert not torch.equal(changed[WEIGHT], before[WEIGHT])
    if option == "delayed":  # the copy's grad_output state moves on with its own training
        key = "model.layers.0.mlp.up_proj.fp8_dy_history"
        assert not torch.equal(changed[key], before[key])


@pytest.mark.parametrize("option", list(OPTIONS))
def test_averaged_model_is_the_ema_of_the_weights(option):
    model, masters = _trained(option, steps=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    _same_kinds(ema.module, model)
    # The weights the model computes with (fp8 weights: their dequantized fp8 values, not the masters).
    def weight():
        w = model.model.layers[0].mlp.up_proj.weight
        return w.detach().clone().as_subclass(torch.Tensor) if option != "fp8_weights" else w.dequantize()

    values = []
    opt = torch.optim.SGD((masters or model).parameters(), lr=0.1)
    for step in range(3):  # the first update copies the weights, the next ones average
        _step(model, masters, opt, step)
        ema.update_parameters(model)
        values.append(weight())
    want = values[0]
    for v in values[1:]:
        want = torch.lerp(want, v, 0.5)
    assert torch.equal(ema.module.state_dict()[WEIGHT], want)
    assert not torch.equal(want, values[-1])  # (the average is not just the last weights)


def test_every_weight_type_answers_exactly_the_structural_ops():
    assert set(HANDLERS) == STRUCTURAL_OPS  # Fp8WeightParam's handlers
    w = Fp8AllGatherWeight(torch.randn(32, 16), f8.Recipe.from_name("tensorwise"))
    assert type(w.detach()) is Fp8AllGatherWeight and type(torch.chunk(w, 2)[0]) is Fp8AllGatherWeight
    assert type(w.clone()) is Fp8AllGatherWeight and type(w * 2) is torch.Tensor
    # aliases count writes together, so a kept scale never outlives an update made through one
    version = w.weight_version()
    with torch.no_grad():
        w.detach().mul_(2)
    assert w.weight_version() != version
    fp8 = Fp8WeightParam(torch.randn(32, 16), f8.Recipe.from_name("tensorwise"))
    assert type(fp8.detach()) is Fp8WeightParam and type(fp8 * 2) is torch.Tensor


@pytest.mark.parametrize("kind", ["fp8_all_gather", "fp8_weights"])
def test_assigning_data_keeps_the_weight_type_and_takes_the_values(kind):
    """``param.data = param.data.to(torch.float32)`` (accelerate's upcast of every trainable parameter
    before fully_shard): the weight stays its type, and its dtype, shape and values are the new
    ones everywhere (its state_dict, a move to meta, what it computes). A plain tensor assigned
    to ``.data`` is wrapped."""
    layer = f8.nn.Fp8Linear(64, 32, dtype=torch.bfloat16, fp8_weights=kind == "fp8_weights")
    w = layer.weight
    cls = Fp8WeightParam if kind == "fp8_weights" else Fp8AllGatherWeight
    before = layer.state_dict()["weight"]
    w.data = w.data.to(torch.float32)
    assert type(layer.weight) is cls and layer.weight is w and w.dtype == torch.float32
    after = layer.state_dict()["weight"]
    assert type(after) is torch.Tensor and after.dtype == torch.float32 and torch.equal(after, before.float())
    assert w.to("meta").dtype == torch.float32 and type(w.to("meta")) is cls
    new = torch.randn(32, 64)
    w.data = new
    assert type(w) is cls and torch.equal(layer.state_dict()["weight"], new)
    if cls is Fp8AllGatherWeight:  # a write through the assigned tensor's aliases makes kept scales stale too
        upcast = w.data.to(torch.float64).float()
        w.data = upcast
        version = w.weight_version()
        upcast.detach().mul_(2)
        assert w.weight_version() != version and torch.equal(layer.state_dict()["weight"], new * 2)
    layer.bias.data = layer.bias.data.float()
    fresh = nn.Linear(64, 32)  # a layer of the same kind built from the values the weight holds now
    fresh.weight.data, fresh.bias.data = layer.state_dict()["weight"].clone(), layer.bias.detach().clone()
    fresh = f8.nn.Fp8Linear.from_linear(fresh, layer.recipe, fp8_weights=kind == "fp8_weights")
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), fresh(x))


@pytest.mark.slow
def test_a_delayed_layer_sharded_on_meta_lists_its_state_as_dtensors():
    """accelerate's cpu_ram_efficient_loading reads the state_dict of the model sharded on the meta
    device, takes every entry's mesh and placements, then loads rank 0's values with
    load_state_dict(assign=True): the delayed-scaling state comes as replicated DTensors there,
    and loads back into the plain buffers with its values."""
    from .dist_harness import run_workers

    [result] = run_workers(_meta_sharded_delayed, 1)
    assert result == ["DTensor"] * 6 + ["loaded"]


def _meta_sharded_delayed(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    model = f8.convert(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32)), "delayed")
    full = model.state_dict()
    mesh = init_device_mesh("cpu", (world_size,))
    model.to("meta")
    fully_shard(model, mesh=mesh)
    meta_sd = model.state_dict()
    names = [k for k in meta_sd if k.startswith("0.fp8_")]
    kinds = [type(meta_sd[k]).__name__ for k in names]
    loaded = {k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in meta_sd.items()}
    assert all(isinstance(loaded[k], DTensor) and loaded[k].placements == (Replicate(),) for k in names)
    model.load_state_dict(loaded, assign=True)
    layer = model[0]
    ok = all(type(getattr(layer, n.split(".")[1])) is torch.Tensor for n in names) and all(
        torch.equal(getattr(layer, n.split(".")[1]), full[n]) for n in names)
    return kinds + ["loaded" if ok else "not loaded"]
