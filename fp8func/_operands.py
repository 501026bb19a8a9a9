"""The operands of the FP8 linear op (``fp8func._autograd``): how its variadic tensor inputs are
laid out, and what its backward keeps of x and of w.

Beyond ``(x, weight, bias)`` the op takes a variable number of tensors: the casts of the weight
and of the input made elsewhere (FSDP2's fp8 all-gather, casts shared by sibling layers), then
the delayed-scaling state. ``Layout`` is their static description, a constant to
``torch.compile``; ``read_inputs`` names them back (``Inputs``).

For each backward GEMM the forward keeps two tensors of its operand, of a kind ``Kept`` names:
the forward's cast where its groups are the same seen transposed (tensorwise, square blocks:
bitwise what a re-cast would give), a transposed copy written in the same pass, a transposed
cast given with the operand, or the high-precision tensor, cast again in the backward.
``operand_for_backward`` turns what was kept into the GEMM's operand.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ._casts import cast
from ._delayed import LinearScalingState, linear_states
from ._gathered import gathered_casts
from ._hooks import read_given
from ._plan import OperandCasts, transposed
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import CastSpec
from ._sharding import Sharding

__all__ = ["Layout", "Inputs", "read_inputs", "Kept", "keep", "operand_for_backward"]


@dataclass(frozen=True)
class Layout:
    """Static description of the op's tensor inputs after (x, weight, bias), in order: each given
    weight cast's (data, scale), each given input cast's, then the delayed-scaling state: six
    tensors, or one packed (``packed_state``)."""

    w_given: tuple[str, ...] = ()
    x_given: tuple[str, ...] = ()
    delayed: bool = False
    packed_state: int = 0  # delayed: L where the state is one packed [3 * (L + 1)] tensor, 0 for six tensors
    transposes: tuple[bool, bool] = (False, False)  # the forward writes x's / w's transposed fp8 copy
    sharding: Sharding | None = None  # delayed: how x's and dy's rows are split over ranks
    x_inside: bool = False  # x exists only as its casts (x_given), read from x itself inside the op

    @property
    def n_given(self) -> int:
        """How many tensor inputs the given casts take: a (data, scale) pair each, none for x's
        casts read from x itself."""
        return 2 * (len(self.w_given) + (0 if self.x_inside else len(self.x_given)))


class Inputs(NamedTuple):
    """The op's variadic tensor inputs, read with its ``Layout``."""

    w_given: dict[str, tuple]  # the weight's casts made elsewhere: name -> (data, scale)
    x_given: dict[str, tuple]  # the input's
    states: LinearScalingState | None  # delayed: the states of x, w and dy
    state_inputs: tuple  # delayed: the state's tensor inputs (six, or one packed)
    x_spec: CastSpec | None = None  # the spec of the "x" cast read from x itself (x_inside), else None


def read_inputs(layout: Layout, x, leaves) -> Inputs:
    """The op's tensor inputs after (x, weight, bias), named (``x``: for casts read from x itself)."""
    it = iter(leaves)
    w = {name: (next(it), next(it)) for name in layout.w_given}
    x_spec = None
    if layout.x_inside:
        # A casts-only input made inside a compiled region (a sequence gather): dynamo cannot read
        # its casts, AOTAutograd, tracing this op, can. They carry their spec: a gather with one
        # scale per rank's chunk of tokens groups the rows by chunk, not as the plan's cast does.
        casts = gathered_casts(x)
        x = {name: (casts[name].data, casts[name].scale) for name in layout.x_given}
        x_spec = casts["x"].spec if "x" in casts else None
    else:
        x = {name: (next(it), next(it)) for name in layout.x_given}
    state_inputs = tuple(it)
    states = linear_states(state_inputs, layout.packed_state) if layout.delayed else None
    return Inputs(w, x, states, state_inputs, x_spec)


class Kept(Enum):
    """What the backward keeps of an operand (x or w) for its backward GEMM: two tensors each."""

    CAST = "cast"  # the forward's cast (data, scale), reused: its groups are the same seen transposed
    CAST_T = "cast_t"  # the transposed copy the forward wrote (or was given) with the forward's cast
    GIVEN = "given"  # the transposed-GEMM cast made elsewhere (w_t / x_t)
    HP = "hp"  # the tensor itself, cast in the backward or used in high precision
    MISSING = "missing"  # nothing the backward can use (None, None)


def keep(casts: OperandCasts, hp: bool, given: dict, name: str, wrote_t: bool, payload: tuple, hp_tensor
         ) -> tuple[Kept, tuple]:
    """What the backward keeps of one operand: (kind, two tensors)."""
    if hp:
        return (Kept.HP, (hp_tensor, hp_tensor)) if not given else (Kept.MISSING, (None, None))
    if given:
        if name + ".T" in given:  # the transposed copy made with the given cast (input_casts)
            return Kept.CAST_T, given[name + ".T"]
        if casts.reuses:
            return Kept.CAST, payload
        t_name = name + "_t"
        return (Kept.GIVEN, given[t_name]) if t_name in given else (Kept.MISSING, (None, None))
    if wrote_t:
        return Kept.CAST_T, payload
    if casts.reuses:
        return Kept.CAST, payload
    return Kept.HP, (hp_tensor, hp_tensor)


def operand_for_backward(kind: Kept, saved: tuple, casts: OperandCasts, dtype, qdy,
                         given_spec: CastSpec | None = None) -> Fp8Tensor:
    """The backward GEMM's ``b`` from what the forward kept: ``[N, K]`` along N for w (grad_input),
    ``[M, K]`` along M for x (grad_weight). ``given_spec``: the spec of the forward's cast where
    the operand came with its own (read from the input itself)."""
    a, b = saved
    if kind is Kept.CAST:
        return Fp8Tensor(a, b, Fp8Meta(given_spec or casts.first, dtype, None))
    if kind is Kept.CAST_T:  # a row-major [K, *] copy: its transpose is column-major, as scaled_mm's b
        return Fp8Tensor(a, b, Fp8Meta(casts.first, dtype, None)).t()
    spec = transposed(casts.second)  # the second cast, written on the operand's own layout
    if kind is Kept.GIVEN:  # read as the layer that made it asks (fp8func._hooks.read_given)
        return Fp8Tensor(read_given(a, qdy.scale) if qdy is not None else a, b, Fp8Meta(spec, dtype, None))
    t = a.reshape(-1, a.shape[-1])
    return cast(t.t(), casts.second)[0].t()  # cast along the other axis: quantize t.T, view it back
