"""A Llama-3-8B-sized decoder layer's training step (fwd+bwd), tokens/s: bf16, torchao, fp8func.

HF transformers ``LlamaDecoderLayer`` built from a config (no download): hidden 4096, MLP 14336,
32 heads / 8 KV heads, sdpa attention, seq 8192, batch 1, bf16, compiled. Every projection of
the layer (q, k, v, o, gate, up, down) is FP8 in the FP8 rows.
"""

from __future__ import annotations

import torch

import fp8func as f8

from ._linear import parse_recipe, torchao_linear
from ._timing import back_to_back_ms, median_ms

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


def _layer(hidden, mlp, heads, kv_heads):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device="cuda", dtype=torch.bfloat16)
    return layer, LlamaRotaryEmbedding(config).to("cuda")


def _convert(layer, impl: str, recipe: str):
    if impl == "fp8func":
        return f8.convert(layer, parse_recipe(recipe)[1], fsdp_fp8_all_gather=False)
    if impl == "torchao":
        if recipe == "blockwise":  # a per-layer swap: torchao's convert has no blockwise config
            for parent in [layer.self_attn, layer.mlp]:
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(parent, name, torchao_linear(child, "blockwise"))
            return layer
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    return layer


def run(seq: int = 8192, hidden: int = 4096, mlp: int = 14336, heads: int = 32, kv_heads: int = 8,
        recipes=RECIPES, iters: int = 20) -> list[dict]:
    rows = []
    x = torch.randn(1, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    positions = torch.arange(seq, device="cuda")[None]
    cases = [("bf16", "-")]
    for r in recipes:  # torchao once per torchao recipe ("tensorwise+fastfwd" compares with "tensorwise")
        base = parse_recipe(r)[0]
        cases += ([] if ("torchao", base) in cases else [("torchao", base)]) + [("fp8func", r)]
    for impl, recipe in cases:
        layer, rope = _layer(hidden, mlp, heads, kv_heads)
        pe = rope(x, positions)
        layer = _convert(layer, impl, recipe)
        fn = torch.compile(layer)

        def step():
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            out = fn(x, position_embeddings=pe, position_ids=positions)
            (out[0] if isinstance(out, tuple) else out).backward(dy)

        ms = median_ms(step, warmup=5, iters=iters)
        b2b = back_to_back_ms(step, warmup=2, iters=iters)
        rows.append({"impl": impl, "recipe": recipe, "ms": ms, "tokens_per_s": seq / ms * 1e3, "b2b_ms": b2b,
                     "b2b_tokens_per_s": seq / b2b * 1e3})
        print(rows[-1], flush=True)
        layer = fn = None  # free the compiled layer before the next case
        torch.compiler.reset()
        torch.cuda.empty_cache()
    for tps in ("tokens_per_s", "b2b_tokens_per_s"):
        ao = {r["recipe"]: r[tps] for r in rows if r["impl"] == "torchao"}
        for r in rows:
            r[tps + "_vs_bf16"] = r[tps] / rows[0][tps]
            ao_recipe = parse_recipe(r["recipe"])[0] if r["impl"] == "fp8func" else None
            r[tps + "_vs_torchao"] = r[tps] / ao[ao_recipe] if ao_recipe in ao else None
    return rows


def table(rows: list[dict]) -> str:
    """Sync: median of single synchronized steps; back-to-back: steady state (see ``bench._linear``)."""
    def vs(v):
        return f"{v:.2f}x" if v else ""

    lines = ["| layer step | recipe | ms sync / back-to-back | tokens/s sync / back-to-back | vs bf16 sync / b2b | "
             "vs torchao sync / b2b |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['recipe']} | {r['ms']:.2f} / {r['b2b_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} / {r['b2b_tokens_per_s']:.0f} | "
                     f"{vs(r['tokens_per_s_vs_bf16'])} / {vs(r['b2b_tokens_per_s_vs_bf16'])} | "
                     f"{vs(r['tokens_per_s_vs_torchao'])} / {vs(r['b2b_tokens_per_s_vs_torchao'])} |")
    return "\n".join(lines)
