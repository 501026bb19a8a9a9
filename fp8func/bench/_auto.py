"""``convert(filter="auto")``'s decisions against isolated layers: which converted layers are slower?

For each shape (tokens x in_features x out_features) and recipe: the decision ``convert(...,
filter="auto", tokens=M)`` takes on one ``nn.Linear`` (and the speedup its roofline model
expects), then the measured fwd+bwd of the bf16 layer and of the same layer in FP8, compiled,
timed synchronized and back to back (``bench._linear``). The FP8 layer is timed whatever the
decision, so the table shows both kinds of error: a converted layer slower than bf16 (counted
in the last line) and a layer kept in bf16 that FP8 would have sped up (a missed gain).

``convert`` prices a layer as it runs inside a compiled model, where its host time overlaps the
other layers' GPU time; an isolated layer pays that host time, so small layers converted for a
model can show here as slower. ``python -m fp8func.bench model --configs ...,auto`` checks the
decisions where they apply, on a whole model.

Default shapes: six linears (4096 to 16384 tokens) plus the Llama-3-8B projections (4096x4096
q/o, 4096x1024 k/v, 4096x14336 gate/up, 14336x4096 down) at 2048, 4096 and 8192 tokens.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import fp8func as f8

from ._linear import SHAPES as LINEAR_SHAPES
from ._linear import fwd_bwd, make_linear, parse_recipe, step_times

PROJECTIONS = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
SHAPES = list(LINEAR_SHAPES) + [(t, k, n) for t in (2048, 4096, 8192) for k, n in PROJECTIONS
                                if (t, k, n) not in LINEAR_SHAPES]
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


def decision(m: int, k: int, n: int, recipe: f8.Recipe) -> tuple[bool, str]:
    """(converted, report note) of ``convert(filter="auto", tokens=m)`` on a ``k -> n`` linear (its plan)."""
    probe = nn.Sequential(nn.Linear(k, n, bias=False, device="meta"))
    row = f8.nn.plan_conversion(probe, recipe, filter="auto", tokens=m, fsdp_fp8_all_gather=False)[0]
    return row.converted, row.reason


def _modelled(note: str) -> float | None:
    """The modelled speedup bf16 / fp8 in a report note ("... fp8 X ms, bf16 Y ms")."""
    found = re.search(r"fp8 ([0-9.]+) ms, bf16 ([0-9.]+) ms", note)
    return float(found.group(2)) / float(found.group(1)) if found else None


def run(shapes=SHAPES, recipes=RECIPES, iters: int = 20) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bf16_ms, bf16_b2b = step_times(fwd_bwd(torch.compile(make_linear(m, k, n)), x, dy), iters)
        torch.compiler.reset()
        for name in recipes:
            recipe = parse_recipe(name)[1]
            converted, note = decision(m, k, n, recipe)
            ours = f8.nn.Fp8Linear.from_linear(make_linear(m, k, n), recipe, fsdp_fp8_all_gather=False)
            fp8_ms, fp8_b2b = step_times(fwd_bwd(torch.compile(ours, fullgraph=True), x, dy), iters)
            torch.compiler.reset()
            row = {"shape": (m, k, n), "recipe": name, "auto_fp8": converted, "modelled": _modelled(note),
                   "bf16_ms": bf16_ms, "bf16_b2b_ms": bf16_b2b, "fp8_ms": fp8_ms, "fp8_b2b_ms": fp8_b2b,
                   "note": note}
            row["verdict"] = verdict(row)
            rows.append(row)
            print(row, flush=True)
        del x, dy
        torch.cuda.empty_cache()
    return rows


def verdict(row: dict) -> str:
    """"ok", "SLOWER" (converted, FP8 slower than bf16 in a timing) or "missed" (kept, FP8 faster in both)."""
    slower = [t for t, key in (("sync", "_ms"), ("b2b", "_b2b_ms")) if row["fp8" + key] > row["bf16" + key]]
    if row["auto_fp8"]:
        return f"SLOWER ({', '.join(slower)})" if slower else "ok"
    return "missed" if not slower else "ok"


def table(rows: list[dict]) -> str:
    lines = ["| M x K x N | recipe | auto | modelled | bf16 ms sync / b2b | fp8 ms sync / b2b | "
             "measured fp8 vs bf16 sync / b2b | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, k, n = r["shape"]
        modelled = f"{r['modelled']:.2f}x" if r["modelled"] else "-"
        lines.append(f"| {m}x{k}x{n} | {r['recipe']} | {'fp8' if r['auto_fp8'] else 'bf16'} | {modelled} | "
                     f"{r['bf16_ms']:.3f} / {r['bf16_b2b_ms']:.3f} | {r['fp8_ms']:.3f} / {r['fp8_b2b_ms']:.3f} | "
                     f"{r['bf16_ms'] / r['fp8_ms']:.2f}x / {r['bf16_b2b_ms'] / r['fp8_b2b_ms']:.2f}x | "
                     f"{r['verdict']} |")
    converted = [r for r in rows if r["auto_fp8"]]
    slower = [r for r in converted if r["verdict"] != "ok"]
    missed = [r for r in rows if r["verdict"] == "missed"]
    lines.append("")
    lines.append(f"filter='auto' converted {len(converted)} of {len(rows)} (shape, recipe) cases; "
                 f"{len(slower)} of them slower than bf16 in some timing; "
                 f"{len(missed)} kept in bf16 where FP8 was faster in both timings.")
    return "\n".join(lines)
