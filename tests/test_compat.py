"""Every torch-private FSDP2 / DTensor read (``fp8func.distributed._compat``) against a real
``fully_shard`` on the running torch: run it on each supported version (2.13 in CI; 2.11 on the GPU
machine: ``pytest tests/test_compat.py``). A reader that stops finding what it reads fails here,
by name, instead of changing the numbers of an FSDP2 run."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fp8func as f8
from fp8func.distributed import Fp8AllGatherWeight, _compat

from .dist_harness import run_workers
from .models import batch, tiny_qwen3


def _readers(rank, world_size, tp):
    """Runs one step; at every fp8 pre-all-gather, records what each reader returns."""
    if tp:
        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    else:
        dp_mesh, tp_mesh = init_device_mesh("cpu", (world_size,)), None
    model = f8.convert(tiny_qwen3(layers=1), "rowwise")
    if tp:
        parallelize_module(model.model.layers[0], tp_mesh, {"mlp.up_proj": ColwiseParallel(),
                                                            "mlp.gate_proj": ColwiseParallel(),
                                                            "mlp.down_proj": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model.model.layers[0], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    names = {id(m): fqn for fqn, m in model.named_modules()}
    seen = []

    def record(weight, module, inputs, mp_policy):
        found = _compat.find_fsdp_param(weight)
        assert found is not None, names[id(module)]
        group, fsdp_param = found
        spec = _compat.tp_spec(fsdp_param)
        seen.append((names[id(module)], _compat.fsdp_pass(group), _compat.reshards_after_forward(group),
                     None if spec is None else tuple(spec.placements)))

    ids, labels = batch(0, rank, seq=16)
    with f8.nn.observe_all_gathers(record):
        model(input_ids=ids, labels=labels).loss.backward()
    local = _compat.local_tensor(model.model.layers[0].mlp.down_proj.weight)
    return {"seen": seen, "local": type(local).__name__,
            "same": local is _compat.find_fsdp_param(local)[1]._sharded_local_tensor}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [False, True])
def test_every_private_reader_finds_what_it_reads(tp):
    r = run_workers(_readers, 2, tp)[0]
    assert r["local"] == Fp8AllGatherWeight.__name__ and r["same"]
    seen = {(fqn, p): (reshard, spec) for fqn, p, reshard, spec in r["seen"]}
    # The block reshards after forward: its row-wise weights gather in the forward, and again in the
    # backward; the root (lm_head) keeps its weights and gathers once.
    up = "model.layers.0.mlp.up_proj"
    assert (up, "forward") in seen and (up, "backward") in seen and seen[(up, "forward")][0] is True
    assert seen[("lm_head", "forward")][0] is False and ("lm_head", "backward") not in seen
    assert seen[(up, "forward")][1] == ((Shard(0),) if tp else None)  # the TP spec, read, never guessed
    assert seen[("model.layers.0.mlp.down_proj", "forward")][1] == ((Shard(1),) if tp else None)
    assert seen[("model.layers.0.self_attn.q_proj", "forward")][1] is None


def test_tp_spec_reads_every_torch_name_and_never_guesses():
    # FSDPParam keeps the TP spec of a DTensor parameter as ``_tp_spec`` up to torch 2.11 and as
    # ``_unsharded_dtensor_spec`` since; a DTensor parameter whose spec is under neither must raise.
    from types import SimpleNamespace

    spec = object()
    assert _compat.tp_spec(SimpleNamespace(_tp_spec=spec, is_dtensor=True)) is spec  # torch <= 2.11
    assert _compat.tp_spec(SimpleNamespace(_unsharded_dtensor_spec=spec, is_dtensor=True)) is spec  # >= 2.12
    assert _compat.tp_spec(SimpleNamespace(_unsharded_dtensor_spec=None, is_dtensor=False)) is None
    with pytest.raises(RuntimeError, match="TP sharding is unknown"):
        _compat.tp_spec(SimpleNamespace(is_dtensor=True))
    assert _compat.fsdp_pass(SimpleNamespace()) == "unknown"


def test_private_reads_live_in_the_compat_module_only():
    import pathlib
    import re

    root = pathlib.Path(f8.__file__).parent
    private = re.compile(r"\._(local_tensor|sharded_local_tensor|training_state|tp_spec|unsharded_dtensor_spec|"
                         r"fsdp_param_group)\b|_module_state_mapping|post_forward_mesh_info")
    shell = [p for d in ("nn", "distributed") for p in (root / d).glob("*.py") if p.name != "_compat.py"]
    found = {p.name: private.findall(p.read_text()) for p in shell + [root / "hf.py"]}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_shell_never_imports_the_distributed_layer():
    # Layering (DESIGN.md): nn -> distributed; the distributed layer registers its weight types with
    # the shell (fp8func.nn._weights) and may import the shell, never the other way round.
    import pathlib
    import re

    root = pathlib.Path(f8.__file__).parent
    imports = re.compile(r"^\s*(from\s+(\.\.distributed|fp8func\.distributed)|import\s+fp8func\.distributed)", re.M)
    found = [p.name for p in (root / "nn").glob("*.py") if imports.search(p.read_text())]
    assert not found, found
    assert f8.nn._weights.weight_type("fp8_weights") is f8.distributed.Fp8WeightParam
