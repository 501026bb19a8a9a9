"""Grouped FP8 GEMMs for mixture-of-experts: tokens grouped by expert, one weight per expert.

Tokens ``x [T, K]`` are sorted by expert; ``offs`` (int32, length E) holds each group's end
row, as ``torch._grouped_mm`` takes it, so group ``g`` is rows ``offs[g-1]:offs[g]`` (empty
when two offsets are equal). Expert weights are ``w [E, N, K]``. The three GEMMs of
``grouped_linear`` and their casts (one per row, reduced along the contraction axis):

    forward      y_g  = x_g  @ w_g.T   x: per token along K       w: per (expert, row n) along K
    grad_input   dx_g = dy_g @ w_g     dy: per token along N      w: per (expert, col k) along N
    grad_weight  dw_g = dy_g.T @ x_g   dy: per (expert, col n)    x: per (expert, col k)
                                       along the tokens of group g only (``quantize_jagged``)

The grad_weight casts reduce along tokens *within a group*: a scale never spans two experts,
so one expert's outlier never coarsens another's gradient, and an empty group gets the EPS
scale and a zero gradient. Those casts are ``JaggedFp8Tensor``s: scale ``[E, C]`` for data
``[T, C]``, which no static ``Granularity`` can describe since the groups depend on ``offs``.

Hardware path: ``torch._scaled_grouped_mm`` (row-wise, CUDA sm90, e4m3, bf16 output). The
emulated twin dequantizes to fp32 and multiplies group by group; it reads ``offs`` on the host,
so under ``torch.compile(fullgraph=True)`` that loop is an opaque custom op (the same body).
"""

from __future__ import annotations

from dataclasses import dataclass

import optree
import torch
import torch.utils._pytree as pytree

from ._formats import E4M3, saturate_cast, tracing
from ._gemm import col_major, log_fallback
from ._ops import dequantize, quantize, reciprocal
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import AxisWise, CastSpec, Recipe, as_recipe, compute_scale

__all__ = ["JaggedFp8Tensor", "quantize_jagged", "dequantize_jagged", "grouped_gemm", "grouped_gemm_path",
           "grouped_linear", "grouped_mm", "align_groups", "group_ids"]


@dataclass(frozen=True)
class JaggedFp8Tensor:
    """A 2-D FP8 tensor cast with one scale per (group along ``dim``, index along the other dim).

    ``x ≈ data.float() * scale.index_select(dim, group_ids(offs, data.shape[dim]))``: ``scale``
    has the data's rank, with ``E`` (the number of groups) entries along ``dim``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    meta: Fp8Meta
    dim: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def t(self) -> "JaggedFp8Tensor":
        """The same quantized values, transposed (views; the grouped dim moves with them)."""
        return JaggedFp8Tensor(self.data.t(), self.scale.t(), self.meta, 1 - self.dim)


pytree.register_pytree_node(
    JaggedFp8Tensor,
    lambda q: ((q.data, q.scale), (q.meta, q.dim)),
    lambda children, aux: JaggedFp8Tensor(*children, *aux),
    serialized_type_name="fp8func.JaggedFp8Tensor",
    flatten_with_keys_fn=lambda q: ([(pytree.GetAttrKey("data"), q.data), (pytree.GetAttrKey("scale"), q.scale)],
                                    (q.meta, q.dim)),
)
optree.register_pytree_node(
    JaggedFp8Tensor,
    lambda q: ((q.data, q.scale), (q.meta, q.dim), ("data", "scale")),
    lambda aux, children: JaggedFp8Tensor(*children, *aux),
    namespace="fp8func",
)


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows (int64): the number of end offsets ``<=`` its index."""
    idx = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, idx, right=True)


def check_offsets(offs, groups: int, rows: int, what: str) -> None:
    """Raises unless ``offs`` is an int32 vector of ``groups`` non-decreasing ends, the last ``rows``.

    The values are read only for CPU tensors outside torch.compile (no device sync); on a GPU
    the emulated op checks them when it reads them anyway.
    """
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.ndim != 1 or offs.numel() != groups:
        got = f"{offs.dtype} of shape {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise ValueError(
            f"{what}: offs is {got}; expected an int32 vector of {groups} group end offsets "
            "(e.g. torch.cumsum(tokens_per_expert, 0, dtype=torch.int32))."
        )
    if offs.device.type == "cpu" and not tracing():
        _check_offset_values(offs.tolist(), rows, what)


def _check_offset_values(ends: list[int], rows: int, what: str) -> None:
    if (ends and (ends[0] < 0 or ends[-1] != rows)) or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(
            f"{what}: offs={ends[:8]}{'...' if len(ends) > 8 else ''} must be non-decreasing group ends "
            f"with the last equal to the {rows} rows; build it with torch.cumsum(counts, 0, dtype=torch.int32)."
        )


def _check_spec(spec: CastSpec, what: str) -> None:
    if not isinstance(spec, CastSpec) or not isinstance(spec.granularity, AxisWise):
        raise ValueError(
            f"{what}: spec={spec!r}; a grouped cast needs an AxisWise granularity (one scale per row "
            "of the operand, reduced along its contraction axis), e.g. Recipe.from_name('rowwise')."
        )


@torch.library.custom_op("fp8func::segment_amax", mutates_args=())
def _segment_amax(xt: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[E, C]`` fp32 max of ``|xt|`` over each group of rows (0 for an empty group, NaN propagated).

    Groups are contiguous row ranges: a segmented max (one pass, no atomics; a scatter_reduce
    serialises the many rows that collide on one address on a GPU). ``unsafe``: no validation
    of the lengths, which would read them on the host (a device sync); ``check_offsets`` did.
    An op of its own so that vmap (segment_reduce has no batching rule) maps it per example.
    """
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.segment_reduce(xt.abs().float(), "max", lengths=counts, axis=0, unsafe=True, initial=0.0)


@_segment_amax.register_fake
def _(xt, offs):
    return xt.new_empty((offs.shape[0], *xt.shape[1:]), dtype=torch.float32)


@_segment_amax.register_vmap
def _(info, in_dims, xt, offs):
    def pick(t, d, i):
        return t if d is None else t.select(d, i)

    return torch.stack([_segment_amax(pick(xt, in_dims[0], i), pick(offs, in_dims[1], i))
                        for i in range(info.batch_size)]), 0


def quantize_jagged(x: torch.Tensor, offs: torch.Tensor, spec: CastSpec, dim: int = 0) -> JaggedFp8Tensor:
    """Casts a 2-D ``x`` with one scale per (group of ``dim``, index of the other dim).

    The amax is reduced along ``dim`` within each group only (``offs`` splits ``dim``), so no
    scale spans two experts. ``spec`` gives dtype and power-of-two rounding; its ``AxisWise``
    granularity reads "reduced along ``dim``". Empty groups get the EPS scale.

    Example:
        >>> x = torch.randn(10, 32); offs = torch.tensor([4, 4, 10], dtype=torch.int32)
        >>> q = quantize_jagged(x, offs, f8.CastSpec(granularity=f8.AxisWise(-1)))
        >>> q.scale.shape
        torch.Size([3, 32])
    """
    _check_spec(spec, "quantize_jagged")
    if x.ndim != 2 or dim not in (0, 1):
        raise ValueError(f"quantize_jagged: x has shape {tuple(x.shape)} and dim={dim}; expected 2 dims, dim 0 or 1.")
    xt = x.detach().movedim(dim, 0)  # [rows, C]: groups along rows; the payload is not differentiable
    gid = group_ids(offs, xt.shape[0])
    # an empty group's amax is 0, hence the EPS scale
    amax = _segment_amax(xt, offs)
    scale = compute_scale(amax, spec.dtype, spec.pow2_scales)  # [E, C]
    data = saturate_cast(xt.float() * reciprocal(scale)[gid], spec.dtype)
    meta = Fp8Meta(spec.with_granularity(AxisWise(dim)), x.dtype, None)
    return JaggedFp8Tensor(data.movedim(0, dim), scale.movedim(0, dim), meta, dim)


def dequantize_jagged(q: JaggedFp8Tensor, offs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q.data.float() * scale`` with each group's scales broadcast over its rows, cast to ``dtype``."""
    scale = q.scale.index_select(q.dim, group_ids(offs, q.shape[q.dim]))
    return (q.data.float() * scale).to(q.meta.orig_dtype if dtype is None else dtype)


def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group fp32 matmul: 2d-3d ``a [M, K] @ b[g] [K, N]`` over row groups -> ``[M, N]``;
    2d-2d ``a[:, grp] [N, M_g] @ b[grp] [M_g, K]`` -> ``[E, N, K]`` (empty group: zeros).

    Operands are laid out canonically (a row-major, b column-major, as scaled_mm takes them), so
    the result depends on the values alone. It reads ``offs`` on the host, so under torch.compile
    it runs as an opaque custom op (the same body: compiled equals eager bitwise).
    """
    if tracing():
        return _grouped_mm_fp32_op(a, b, offs)
    return _grouped_mm_loop(a, b, offs)


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    _check_offset_values(ends, a.shape[0] if b.ndim == 3 else a.shape[1], "grouped_gemm")
    a, b = a.contiguous(), b.transpose(-2, -1).contiguous().transpose(-2, -1)
    spans = [(g, s, e) for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)) if e > s]
    if b.ndim == 3:
        out = a.new_zeros((a.shape[0], b.shape[2]))
        for g, s, e in spans:
            out[s:e] = a[s:e] @ b[g]
    else:
        out = a.new_zeros((len(ends), a.shape[0], b.shape[1]))
        for g, s, e in spans:
            out[g] = a[:, s:e] @ b[s:e]
    return out


@torch.library.custom_op("fp8func::grouped_mm_fp32", mutates_args=())
def _grouped_mm_fp32_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_loop(a, b, offs)


@_grouped_mm_fp32_op.register_fake
def _(a, b, offs):
    if b.ndim == 3:
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))


@_grouped_mm_fp32_op.register_vmap
def _(info, in_dims, a, b, offs):
    def pick(t, d, i):
        return t if d is None else t.select(d, i)

    return torch.stack([_grouped_mm_fp32_op(*(pick(t, d, i) for t, d in zip((a, b, offs), in_dims)))
                        for i in range(info.batch_size)]), 0


def _kind(a, b) -> str:
    """ "2d-3d" (tokens x per-expert weights) or "2d-2d" (per-expert weight gradients), else raise."""
    if isinstance(a, Fp8Tensor) and isinstance(b, Fp8Tensor) and a.ndim == 2 and b.ndim == 3:
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"grouped_gemm: {_shapes(a, b)}; expected a [M, K] and b [E, K, N].")
        return "2d-3d"
    if isinstance(a, JaggedFp8Tensor) and isinstance(b, JaggedFp8Tensor) and a.dim == 1 and b.dim == 0:
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"grouped_gemm: {_shapes(a, b)}; expected a [N, M] and b [M, K].")
        return "2d-2d"
    raise TypeError(
        f"grouped_gemm: a is a {type(a).__name__} and b a {type(b).__name__} ({_shapes(a, b)}); expected "
        "Fp8Tensors a [M, K] and b [E, K, N], or JaggedFp8Tensors a [N, M] "
        "grouped along dim 1 and b [M, K] grouped along dim 0 (quantize_jagged(...).t() and quantize_jagged(...))."
    )


def _shapes(a, b) -> str:
    return f"a is {tuple(getattr(a, 'shape', ()))} and b {tuple(getattr(b, 'shape', ()))}"


def _hardware_why(kind: str, a, b) -> str:
    """Why ``torch._scaled_grouped_mm`` cannot compute this product ("" when it can)."""
    if a.device.type != "cuda":
        return f"no FP8 grouped GEMM on device {a.device}"
    cap = torch.cuda.get_device_capability(a.device)
    if cap != (9, 0):
        return f"row-wise grouped scaled_mm runs on sm90 only, this GPU is sm{cap[0]}{cap[1]}"
    if a.dtype != E4M3 or b.dtype != E4M3:
        return "row-wise grouped scaled_mm takes e4m3 operands only"
    dims = (a.shape[1], b.shape[2]) if kind == "2d-3d" else (a.shape[0], a.shape[1], b.shape[1])
    if any(d % 16 for d in dims):
        return f"grouped scaled_mm needs the dims {tuple(dims)} divisible by 16"
    if kind == "2d-3d" and (a.scale.shape[1] != 1 or b.scale.shape[1] != 1):
        return "grouped scaled_mm needs one scale per row of a and per column of b (row-wise casts)"
    return ""


def grouped_gemm_path(a, b, path: str = "auto") -> str:
    """Which path ``grouped_gemm(a, b, ..., path=path)`` runs: ``"scaled_grouped_mm"`` or ``"emulated"``."""
    kind = _kind(a, b)
    if path == "emulated":
        return "emulated"
    if path not in ("auto", "hardware"):
        raise ValueError(f"grouped_gemm: path={path!r}; expected 'auto', 'hardware' or 'emulated'.")
    why = _hardware_why(kind, a, b)
    if path == "hardware" and why:
        raise ValueError(f"grouped_gemm(path='hardware'): {why}. Use path='auto' to fall back to emulation.")
    if path == "auto" and a.device.type == "cpu":
        return "emulated"
    if why:
        log_fallback(why)
        return "emulated"
    return "scaled_grouped_mm"


def _scaled_grouped_mm(kind: str, a, b, offs: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_grouped_mm``: a row-major, b column-major, 1-D/2-D contiguous fp32 scales."""
    if kind == "2d-3d":  # a [M, K], scale [M]; b [E, K, N] column-major per expert, scale [E, N]
        (m, _), (e, _, n) = a.shape, b.shape
        sa, sb = a.scale.expand(m, 1).reshape(m).contiguous(), b.scale.expand(e, 1, n).reshape(e, n).contiguous()
        db = b.data if b.data.stride(-2) == 1 else b.data.transpose(-2, -1).contiguous().transpose(-2, -1)
    else:  # a [N, M] with scales [N, E]; b [M, K] with [E, K]: both given group-major, [E*N] and [E*K]
        sa, sb = a.scale.t().contiguous().reshape(-1), b.scale.contiguous().reshape(-1)
        db = col_major(b.data)
    # Only bf16 output exists (CUTLASS row-wise grouped kernel); the cast is the one extra rounding.
    y = torch._scaled_grouped_mm(a.data.contiguous(), db, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast_accum)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def grouped_gemm(a, b, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                 path: str = "auto", fast_accum: bool = False) -> torch.Tensor:
    """Grouped FP8 product, one GEMM per group of ``offs``, in ``out_dtype``.

    * ``a`` Fp8Tensor ``[M, K]`` (rows grouped), ``b`` Fp8Tensor ``[E, K, N]``: rows of group
      ``g`` times ``b[g]`` -> ``[M, N]``.
    * ``a`` JaggedFp8Tensor ``[N, M]`` (grouped along dim 1), ``b`` JaggedFp8Tensor ``[M, K]``
      (along dim 0): ``a[:, grp] @ b[grp]`` per group -> ``[E, N, K]``; zeros for an empty group.

    On the hardware path (CUDA sm90) torch's kernel asserts on the device unless, in the second
    form, every group is a positive multiple of 16 rows: ``align_groups`` pads them.
    ``fast_accum``: ``use_fast_accum`` for that kernel (no periodic fp32 promotion of the
    accumulator: several times faster for MoE experts, docs/benchmarks.md; see ``Recipe.fast_accum``).

    Example:
        >>> qa = f8.quantize(torch.randn(10, 32), spec)                        # spec: AxisWise(-1)
        >>> qb = f8.quantize(torch.randn(3, 16, 32), spec).transpose(1, 2)     # [3, 32, 16]
        >>> grouped_gemm(qa, qb, torch.tensor([4, 4, 10], dtype=torch.int32)).shape
        torch.Size([10, 16])
    """
    kind = _kind(a, b)
    groups = b.shape[0] if kind == "2d-3d" else a.scale.shape[1]
    check_offsets(offs, groups, a.shape[0] if kind == "2d-3d" else a.shape[1], "grouped_gemm")
    if grouped_gemm_path(a, b, path) == "scaled_grouped_mm":
        return _scaled_grouped_mm(kind, a, b, offs, out_dtype, fast_accum)
    if kind == "2d-3d":
        a_hp, b_hp = dequantize(a, torch.float32), dequantize(b, torch.float32)
    else:
        a_hp, b_hp = dequantize_jagged(a, offs, torch.float32), dequantize_jagged(b, offs, torch.float32)
    return _grouped_mm_fp32(a_hp, b_hp, offs).to(out_dtype)


def _check_recipe(recipe: Recipe) -> None:
    for role, spec in (("input", recipe.input), ("weight", recipe.weight), ("grad_output", recipe.grad_output),
                       ("grad_input_weight", recipe.weight_for_grad_input)):
        if not isinstance(spec.granularity, AxisWise) or spec.granularity.axis not in (-1, 1):
            raise ValueError(
                f"grouped_linear: recipe {recipe.name!r} casts {role} with {spec.granularity}; grouped GEMMs "
                "take row-wise casts (AxisWise(-1): one scale per row along the contraction axis). "
                "Use Recipe.from_name('rowwise') or a Recipe whose casts are all AxisWise(-1)."
            )


class _GroupedLinearFn(torch.autograd.Function):
    """``y = x_g @ w_g.T`` per group; see the module docstring for the three GEMMs' casts."""

    @staticmethod
    def forward(x, w, offs, recipe: Recipe):
        qx = quantize(x, recipe.input)  # [T, K], one scale per token
        qw = quantize(w, recipe.weight).transpose(1, 2)  # [E, K, N], one per (expert, output row)
        return grouped_gemm(qx, qw, offs, x.dtype, path=recipe.path, fast_accum="output" in recipe.fast_accum)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, offs, recipe = inputs
        ctx.recipe = recipe
        ctx.save_for_backward(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        r: Recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy = quantize(dy, r.grad_output)  # [T, N] along N
            qw = quantize(w.transpose(1, 2), r.weight_for_grad_input).transpose(1, 2)  # [E, N, K] along N
            dx = grouped_gemm(qdy, qw, offs, x.dtype, path=r.path, fast_accum="grad_input" in r.fast_accum)
        if ctx.needs_input_grad[1]:
            if r.grad_weight_hp:
                dw = _grouped_mm_fp32(dy.t().float(), x.float(), offs)
            else:  # both along the tokens of each expert's group: [N, T] and [T, K]
                qdy_t = quantize_jagged(dy, offs, r.grad_output).t()
                dw = grouped_gemm(qdy_t, quantize_jagged(x, offs, r.input), offs, w.dtype, path=r.path,
                                  fast_accum="grad_weight" in r.fast_accum)
            dw = dw.to(w.dtype)
        return dx, dw, None, None

    @staticmethod
    def vmap(info, in_dims, x, w, offs, recipe):
        # Per-example semantics, as linear's: each example (e.g. each member of an ensemble of MoE
        # layers) gets its own scales and groups.
        def pick(t, d, i):
            return t if d is None else t.select(d, i)

        outs = [_GroupedLinearFn.apply(pick(x, in_dims[0], i), pick(w, in_dims[1], i), pick(offs, in_dims[2], i),
                                       recipe) for i in range(info.batch_size)]
        return torch.stack(outs), 0


torch._dynamo.allow_in_graph(_GroupedLinearFn)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                   recipe: Recipe | str = "rowwise") -> torch.Tensor:
    """FP8 expert layer: ``y[grp] = x[grp] @ w[g].T`` for each group ``g`` of ``offs``; differentiable.

    Works under ``torch.func.grad`` / ``vjp`` / ``vmap`` (each example its own scales and groups),
    ``torch.compile(fullgraph=True)`` and their compositions.

    Args:
        x: ``[T, K]`` tokens sorted by expert (bf16 or fp32); the output has its dtype.
        w: ``[E, N, K]`` expert weights; the gradient comes back in their dtype.
        offs: int32 ``[E]`` cumulative group ends (``offs[-1] == T``); equal neighbours: an empty group.
        recipe: a row-wise ``Recipe`` or its name.

    Example:
        >>> x = torch.randn(10, 32, requires_grad=True); w = torch.randn(3, 16, 32, requires_grad=True)
        >>> grouped_linear(x, w, torch.tensor([4, 4, 10], dtype=torch.int32)).sum().backward()
    """
    recipe = as_recipe(recipe, "grouped_linear", example="rowwise")
    _check_recipe(recipe)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"grouped_linear: x has shape {tuple(x.shape)} and w {tuple(w.shape)}; expected x [T, K] (tokens "
            "sorted by expert) and w [E, N, K]. Flatten leading dims of x first: x.reshape(-1, K)."
        )
    check_offsets(offs, w.shape[0], x.shape[0], "grouped_linear")
    return _GroupedLinearFn.apply(x, w, offs, recipe)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """High-precision twin of ``grouped_linear``: ``x[grp] @ w[g].T`` in ``x``'s dtype.

    ``torch._grouped_mm`` for bf16 on CUDA; elsewhere a loop over groups (its CPU backward
    fails in torch 2.13, and its meta function takes bf16 only), differentiable either way.
    """
    check_offsets(offs, w.shape[0], x.shape[0], "grouped_mm")
    w = w.to(x.dtype)
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    ends = offs.tolist()
    parts = [x[s:e] @ w[g].t() for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))


def align_groups(offs: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A layout whose groups are positive multiples of ``align`` rows (zero rows appended).

    Returns ``(index, offs_aligned, rows)``: row ``i`` moves to ``index[i]`` of a ``rows``-row
    buffer whose group ends are ``offs_aligned``. Empty groups get ``align`` zero rows too (the
    CUTLASS kernel rejects empty ones). Zero rows change no amax and add exact zeros. Reads
    the total on the host (one sync).
    """
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = ((counts + align - 1) // align * align).clamp(min=align)
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    n = int(offs[-1]) if offs.numel() else 0
    gid = group_ids(offs, n)
    within = torch.arange(n, device=offs.device) - (offs - counts)[gid]
    index = (ends - padded)[gid] + within
    return index, ends, int(ends[-1]) if ends.numel() else 0

