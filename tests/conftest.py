import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _fp8_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible)"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return f"needs an FP8-capable GPU (sm89+), this one is sm{cap[0]}{cap[1]}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _fp8_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_process_unless_slow(request, monkeypatch):
    # `python -m pytest` (the quick tier) runs in one process; tests that spawn ranks are `slow`.
    from . import dist_harness

    monkeypatch.setattr(dist_harness, "SPAWN_ALLOWED", request.node.get_closest_marker("slow") is not None)


@pytest.fixture(autouse=True)
def _no_tf32():
    # The emulated GEMM is an fp32 reference; TF32 would make it something else.
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev
