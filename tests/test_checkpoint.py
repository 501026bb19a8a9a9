"""torch.distributed.checkpoint under FSDP2: stop at step 10, resume, and steps 11-20 are bitwise
the uninterrupted run's (model, optimizer, and fp8func's scaling state where there is one; for fp8
weights, ``MasterWeights`` and the optimizer, the fp8 weights re-quantized from the loaded masters)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8

from .dist_harness import run_workers
from .models import batch, tiny_qwen3

pytestmark = pytest.mark.slow  # every test here spawns processes (gloo or torchrun)


def _model(recipe, fp8_gather):
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = tiny_qwen3()
    f8.convert(model, recipe, fsdp_fp8_all_gather=fp8_gather, fp8_weights=fp8_gather == "fp8_weights")
    if recipe == "delayed":  # one scaling state on every rank (each rank sees its own batch)
        f8.distributed.share_scaling_state(model, mesh)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if fp8_gather == "fp8_weights":  # the optimizer trains the masters; they are what is saved
        masters = f8.nn.MasterWeights(model)
        return model, masters, torch.optim.AdamW(masters.parameters(), lr=3e-3)
    return model, model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _steps(model, trained, opt, rank, first, last):
    losses = []
    for step in range(first, last):
        ids, labels = batch(step, rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if trained is model:
            opt.step()
            opt.zero_grad()
        else:
            trained.step(opt)  # MasterWeights: grads to masters, step, re-quantize, zero_grad
        losses.append(loss.item())
    return losses


def _run(rank, world_size, recipe, fp8_gather, ckpt_dir):
    model, trained, opt = _model(recipe, fp8_gather)
    straight = _steps(model, trained, opt, rank, 0, 20)

    model, trained, opt = _model(recipe, fp8_gather)
    first = _steps(model, trained, opt, rank, 0, 10)
    msd, osd = get_state_dict(trained, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    del model, trained, opt

    model, trained, opt = _model(recipe, fp8_gather)  # a fresh process would start here
    msd, osd = get_state_dict(trained, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    # For MasterWeights, set_state_dict's load_state_dict re-quantizes the fp8 weights from the masters.
    set_state_dict(trained, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _steps(model, trained, opt, rank, 10, 20)
    kinds = {type(p.to_local()).__name__ for p in model.parameters()}
    states = {k: v.clone() for k, v in model.state_dict().items() if "fp8_" in k}
    return {"straight": straight, "resumed": first + resumed, "local_kinds": kinds, "states": states}


@pytest.mark.parametrize("recipe,fp8_gather", [("tensorwise", True), ("rowwise", True), ("tensorwise", False),
                                              ("delayed", False), ("rowwise", "fp8_weights")])
def test_dcp_resume_is_bitwise_the_uninterrupted_run(recipe, fp8_gather, tmp_path):
    results = run_workers(_run, 2, recipe, fp8_gather, str(tmp_path / "ckpt"))
    for r in results:
        assert r["straight"] == r["resumed"], (r["straight"][9:12], r["resumed"][9:12])
        # the fp8 all-gather weights survive the load: still Fp8AllGatherWeight shards
        assert ("Fp8AllGatherWeight" in r["local_kinds"]) == (fp8_gather is True), r["local_kinds"]
        # fp8 weights (saved through their masters) are still Fp8WeightParam shards
        assert ("Fp8WeightParam" in r["local_kinds"]) == (fp8_gather == "fp8_weights"), r["local_kinds"]
    if recipe == "delayed":  # 6 state buffers per layer (2 x 7 projections + lm_head), same on both ranks
        a, b = (r["states"] for r in results)
        assert len(a) == 6 * (7 * 2 + 1) and all(torch.equal(a[k], b[k]) for k in a)
        assert all(v.abs().sum() > 0 for k, v in a.items() if "history" in k)
