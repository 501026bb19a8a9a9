"""The way back: ``unconvert`` (plain ``nn.Linear``s with the same weights) and ``export_fp8`` (an
FP8 inference checkpoint in safetensors), read back by a reference loader that dequantizes it as
vLLM's FP8 loaders do (``weight_fp8.float() * weight_scale``)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fp8func as f8

from .models import batch
from .test_checkpoint_copies import OPTIONS, WEIGHT, _loss, _tiny, _trained


def _linear_fqns(model):
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_unconvert_gives_plain_linears_with_the_same_weights(option):
    model, masters = _trained(option)
    expected = {k: v.clone() for k, v in model.state_dict().items() if ".fp8_" not in k}
    bias_before = model.model.layers[0].mlp.up_proj.bias
    kept = model.model.layers[0].mlp.up_proj.weight
    assert f8.unconvert(model) is model
    assert all(type(model.get_submodule(fqn)) is nn.Linear for fqn in _linear_fqns(model))
    sd = model.state_dict()
    assert sorted(sd) == sorted(expected)  # delayed-scaling state dropped, nothing else
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    up = model.model.layers[0].mlp.up_proj
    assert up.bias is bias_before and type(up.weight) is nn.Parameter and up.weight.requires_grad
    if option in ("defaults", "rowwise"):  # the tensor the fp8 all-gather weight wrapped: no copy
        assert up.weight.data_ptr() == kept.hp_values().data_ptr()
    if option == "fp8_weights":  # the master's values, the ones the optimizer trained
        assert torch.equal(up.weight, masters.model__layers__0__mlp__up_proj__weight)
    plain = _tiny(seed=1)
    plain.load_state_dict(sd)
    assert torch.equal(_loss(plain), _loss(model))  # an ordinary model now


def test_unconvert_gives_back_hf_moe_experts():
    from .test_moe_ep import _tiny_qwen3_moe

    ref, model = _tiny_qwen3_moe(), _tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    f8.convert(model, "rowwise")
    assert isinstance(model.model.layers[0].mlp.experts, f8.nn.Fp8Experts)
    f8.unconvert(model)
    assert model.model.layers[0].mlp.experts is experts  # the HF module, with its parameters
    ids, _ = batch(0, 0, seq=16)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.slow
def test_unconvert_refuses_sharded_layers():
    from .dist_harness import run_workers

    assert run_workers(_unconvert_sharded, 1) == ["raised"]


def _unconvert_sharded(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = f8.convert(_tiny(), "tensorwise")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        f8.unconvert(model)
    except ValueError as e:
        assert "unconvert before fully_shard" in str(e), e
        return "raised"
    return "unconverted"


def load_fp8(path) -> dict[str, torch.Tensor]:
    """A reference reader of the exported layout: every ``weight`` with a ``weight_scale`` beside it
    dequantized (``weight.float() * weight_scale``, the scale broadcast per tensor or per row)."""
    tensors = load_file(path / "model.safetensors")
    out = {}
    for key, value in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        scale = tensors.get(key + "_scale")
        if scale is not None:
            assert value.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            assert scale.shape in ((), (value.shape[0], 1)), scale.shape
            value = value.float() * scale
        out[key] = value
    return out


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("option", ["defaults", "fp8_weights", "delayed"])
def test_export_fp8_dequantizes_within_the_format_error(option, granularity, tmp_path):
    model, _ = _trained(option)
    hp = {k: v.clone() for k, v in model.state_dict().items()}
    config = f8.export_fp8(model, tmp_path, granularity=granularity)
    raw = load_file(tmp_path / "model.safetensors")
    got = load_fp8(tmp_path)
    fp8 = [k for k in raw if k + "_scale" in raw]
    assert WEIGHT in fp8 and "lm_head.weight" not in fp8  # the output head stays high precision
    assert not any(".fp8_" in k for k in raw)  # no delayed-scaling state
    for k in fp8:
        w, scale = hp[k], raw[k + "_scale"]
        # e4m3: 3 mantissa bits, so half an ulp is 2^-4 of the value; subnormals (below 2^-6 in
        # scaled units) round to a step of 2^-9: half of it, 2^-10, in scaled units.
        bound = w.abs() * 2.0 ** -4 + scale * 2.0 ** -10
        assert ((got[k] - w).abs() <= bound).all(), (k, ((got[k] - w).abs() - bound).max())
        amax = w.abs().amax(dim=1) if granularity == "channel" else w.abs().amax()
        torch.testing.assert_close(scale.reshape(-1), amax.reshape(-1) / 448.0, rtol=1e-6, atol=0)
    for k in set(raw) - set(fp8) - {k + "_scale" for k in fp8}:
        assert torch.equal(raw[k], hp[k]), k
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert written == config and "lm_head" in (config.get("ignored_layers") or config.get("ignore"))
    assert config["quant_method"] == ("fp8" if granularity == "tensor" else "compressed-tensors")


def test_export_fp8_dtype_and_errors(tmp_path):
    model, _ = _trained("rowwise")
    f8.export_fp8(model, tmp_path, granularity="channel", dtype=torch.bfloat16, exclude=())
    raw = load_file(tmp_path / "model.safetensors")
    assert raw["lm_head.weight"].dtype == torch.float8_e4m3fn  # exclude=(): the head in FP8 too
    assert raw["model.norm.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="expected 'tensor' or 'channel'"):
        f8.export_fp8(model, tmp_path, granularity="block")
    with pytest.raises(ValueError, match="no Fp8Linear layer"):
        f8.export_fp8(_tiny(), tmp_path)
