"""The public API contract, packaging, and the error messages of the scaling layer."""

import importlib
import importlib.util
import pathlib
import re
import sys

import pytest
import torch

import fp8func as f8


def test_public_names_exist_as_written():
    assert f8.E4M3 is torch.float8_e4m3fn and f8.E5M2 is torch.float8_e5m2
    f8.TensorWise()
    f8.AxisWise(axis=-1)
    f8.BlockWise((1, 128))
    f8.BlockWise((128, 128))
    f8.MX(block=32)
    spec = f8.CastSpec(dtype=f8.E4M3, granularity=f8.TensorWise(), power_of_2=False)
    assert hash(spec) == hash(f8.CastSpec())
    for name in ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"]:
        assert f8.Recipe.from_name(name).name == name
    for name in f8.__all__:
        assert hasattr(f8, name), name


def test_named_recipes_are_what_the_docs_say():
    tw = f8.Recipe.from_name("tensorwise")
    assert (tw.input.dtype, tw.weight.dtype, tw.grad_output.dtype) == (f8.E4M3, f8.E4M3, f8.E5M2)
    row = f8.Recipe.from_name("rowwise")
    assert row.input == row.weight == row.grad_output == f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True)
    hp = f8.Recipe.from_name("rowwise_with_gw_hp")
    assert hp.grad_weight_hp and hp.weight_for_grad_input.granularity == f8.TensorWise()
    blk = f8.Recipe.from_name("blockwise")
    assert blk.weight.granularity == f8.BlockWise((128, 128)) and blk.input.granularity == f8.BlockWise((1, 128))
    assert f8.Recipe.from_name("mxfp8").input.pow2_scales
    assert f8.Recipe.from_name("rowwise", path="emulated").path == "emulated"


def test_extras_hold_what_the_demo_and_fp8func_hf_import():
    tomllib = pytest.importorskip("tomllib")
    from fp8func.demo import _train

    extras = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {extra: {re.split(r"[<>=\[ ]", req)[0] for req in reqs} for extra, reqs in extras.items()}
    assert names["demo"] == set(_train.DEMO_PACKAGES) == {"transformers", "matplotlib"}
    assert names["hf"] == {"transformers", "accelerate"}
    assert names["demo"] | names["hf"] | {"pytest", "hypothesis", "torchao"} <= names["dev"]
    assert "torchao" not in names["demo"] | names["hf"]  # its import prints C-extension load failures


def test_fp8func_hf_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "fp8func.hf", raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"^fp8func.hf needs transformers \(and accelerate for FSDP2\): "
                                          r"pip install 'fp8func\[hf\]'"):
        importlib.import_module("fp8func.hf")


def test_kernels_installed_as_subpackage_only():
    import fp8func.kernels  # noqa: F401

    spec = importlib.util.find_spec("kernels")
    assert spec is None or "fp8func" in str(spec.origin) or "site-packages/kernels" not in str(spec.origin)


def test_scaling_errors():
    with pytest.raises(ValueError,
                       match=r"BlockWise\(block=\(128, 128\)\) does not divide a tensor of shape \(100, 256\)"):
        f8.quantize(torch.randn(100, 256), f8.CastSpec(granularity=f8.BlockWise((128, 128))))
    with pytest.raises(ValueError, match=r"has 3 block dims but the tensor of shape \(4, 4\) has only 2"):
        f8.quantize(torch.randn(4, 4), f8.CastSpec(granularity=f8.BlockWise((1, 2, 2))))
    with pytest.raises(ValueError, match=r"needs a non-empty tuple of positive ints"):
        f8.BlockWise((0, 128))
    with pytest.raises(ValueError, match=r"MX\(block=0\) needs a positive int block"):
        f8.MX(block=0)
    with pytest.raises(ValueError, match=r"AxisWise\(axis=2\): axis=2 is out of range for a tensor with 2 dims"):
        f8.quantize(torch.randn(4, 4), f8.CastSpec(granularity=f8.AxisWise(2)))
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 is not an FP8 element type"):
        f8.CastSpec(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="expected an instance of TensorWise, AxisWise, BlockWise or MX"):
        f8.CastSpec(granularity="rowwise")
    with pytest.raises(TypeError, match=r"Recipe.input='x' is not a CastSpec"):
        f8.Recipe(input="x")
    with pytest.raises(ValueError, match=r"Recipe\(path='gpu'\): expected one of"):
        f8.Recipe(path="gpu")


def test_ops_errors():
    with pytest.raises(TypeError, match=r"expected a high-precision floating tensor .*got dtype=torch.int64"):
        f8.quantize(torch.arange(4), f8.CastSpec())
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        f8.quantize([1.0], f8.CastSpec())
    with pytest.raises(TypeError, match="spec='rowwise' is not a CastSpec"):
        f8.quantize(torch.randn(2, 2), "rowwise")
    with pytest.raises(ValueError, match=r"scale has shape \(2, 1\) .* needs float32 scales of shape \(1, 1\)"):
        f8.quantize_with_scale(torch.randn(2, 2), torch.ones(2, 1), f8.CastSpec())
    with pytest.raises(TypeError, match="dequantize: expected an Fp8Tensor, got Tensor"):
        f8.dequantize(torch.randn(2))
    q = f8.quantize(torch.randn(2, 4, 4), f8.CastSpec())
    with pytest.raises(ValueError, match=r"Fp8Tensor.t\(\) needs 2 dims, got shape \(2, 4, 4\)"):
        q.t()
    with pytest.raises(ValueError, match="needs positive power-of-two scales"):
        f8.to_e8m0(torch.tensor([3.0]))
    with pytest.raises(ValueError, match="round_up_to_pow2 takes float32 scales"):
        f8.round_up_to_pow2(torch.tensor([3.0], dtype=torch.float64))


def test_check_finite_refuses_compile():
    fn = torch.compile(lambda t: f8.quantize(t, f8.CastSpec(), check_finite=True), fullgraph=True)
    with pytest.raises(Exception, match=r"check_finite=True\) reads the tensor on the host"):
        fn(torch.randn(4))


def test_the_guide_cites_tests_that_exist():
    """Every test the user guide's compatibility matrix cites exists: `tests/x.py::name`, and the
    shorthand `::name` for another test of the file cited just before."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[1]
    refs = re.findall(r"`(tests/\w+\.py)?((?:::\w+)?)`", (root / "docs" / "guide.md").read_text())
    checked, current = 0, None
    for file, name in refs:
        if file:
            current = root / file
            assert current.exists(), file
        if name:
            assert current is not None and f"def {name[2:]}(" in current.read_text(), (current, name)
            checked += 1
    assert checked >= 15, checked


def test_api_reference_lists_every_public_name():
    """docs/api.md (python docs/make_api.py) has an entry for every name in the public __all__s."""
    import pathlib

    import fp8func.kernels as kernels

    api = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    for prefix, mod in (("fp8func", f8), ("fp8func.nn", f8.nn), ("fp8func.distributed", f8.distributed),
                        ("fp8func.kernels", kernels)):
        missing = [n for n in mod.__all__ if f"### `{prefix}.{n}" not in api]
        assert not missing, f"docs/api.md lacks {missing}: run python docs/make_api.py"


def test_api_reference_is_what_make_api_writes():
    """docs/api.md is generated: signatures and first docstring paragraphs as the code has them."""
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("make_api", root / "docs" / "make_api.py")
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    written = (root / "docs" / "api.md").read_text().splitlines()
    current = make_api.render().splitlines()
    stale = [f"{i + 1}: {a!r} != {b!r}" for i, (a, b) in enumerate(zip(written, current)) if a != b][:3]
    assert written == current, f"docs/api.md is out of date ({stale or 'length differs'}): run python docs/make_api.py"
