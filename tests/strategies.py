"""Hypothesis strategies that draw tensors through a seed (fast) plus chosen special values."""

import torch
from hypothesis import strategies as st

HP_DTYPES = (torch.float32, torch.bfloat16)


@st.composite
def tensors(draw, shapes, dtypes=HP_DTYPES, log2_range=(-24, 24), specials=False):
    """A random tensor of one of ``shapes``: gaussian times 2**e, with optional outliers/zeros."""
    shape = draw(shapes)
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    e = draw(st.integers(*log2_range))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32) * 2.0**e
    if specials and x.numel():
        kind = draw(st.sampled_from(["none", "zeros", "outlier", "tiny"]))
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 7),), generator=g)
        if kind == "zeros":
            flat[idx] = 0.0
        elif kind == "outlier":
            flat[idx[:1]] = 2.0 ** (e + 12)
        elif kind == "tiny":
            flat[idx] = 2.0 ** (e - 30)
    return x.to(dtype)


def shapes_2d(mult=(1, 1), max_groups=6):
    """2-D shapes whose dims are multiples of ``mult``."""
    return st.tuples(
        st.integers(1, max_groups).map(lambda g: g * mult[0]),
        st.integers(1, max_groups).map(lambda g: g * mult[1]),
    )


def shapes_nd(min_dims=1, max_dims=4, max_side=9):
    return st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims).map(tuple)
