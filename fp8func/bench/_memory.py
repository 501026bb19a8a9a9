"""Parameter memory of a Llama-style model with bf16 weights vs FP8 weights (``fp8_weights=True``).

One process, one table: the bytes of the model's parameters (what forward and backward read, and
what FSDP2 shards and all-gathers), then, for honesty, the training state around them: the
high-precision masters ``MasterWeights`` keeps for fp8 weights (fp32) and AdamW's two moments.

The model (default: hidden 2048, intermediate 8192, 16 layers, vocab 32000, untied: 1.21B
parameters) is built on the ``meta`` device and materialised one block at a time (``to_empty``,
init, and for fp8 weights the quantization that drops the staged bf16 values), so the figures
are not inflated by a full bf16 copy that would only exist during init. ``device="cpu"`` runs the
same logic and counts storage bytes instead of reading the CUDA allocator (the CPU smoke test
does that on a tiny config).

    python -m fp8func.bench memory [--recipes tensorwise,rowwise]
"""

from __future__ import annotations

import torch
from torch import nn

import fp8func as f8
from fp8func.distributed import Fp8WeightParam

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                tie_word_embeddings=False)
RECIPES = ("tensorwise", "rowwise")


def build(config: dict, recipe: str | None, device: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model in ``dtype``, built on meta, converted, and materialised block by block on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    if recipe is not None:
        f8.convert(model, recipe, fp8_weights=True)
    blocks = list(model.model.layers) + [model.model.embed_tokens, model.model.norm, model.model.rotary_emb,
                                         model.lm_head]
    torch.manual_seed(0)
    for block in blocks:
        block.to_empty(device=device)
        with torch.no_grad():
            block.apply(model._init_weights)
        for p in block.parameters():
            if isinstance(p, Fp8WeightParam):
                p.casts()  # quantize now (whole-tensor amax, one process): the staged bf16 copy goes
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"fp8func.bench memory: {left[:3]} stayed on meta; add their module to the blocks.")
    return model


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (each storage once; an fp8 weight's payloads,
    scales and staged values)."""
    seen, total = set(), 0
    for t in tensors:
        inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]] if isinstance(t, Fp8WeightParam) else [t]
        for x in inner:
            key = (x.device, x.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
    return total


def _allocated(device: str) -> int | None:
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def measure(recipe: str | None, config: dict = LLAMA_1B, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
            ) -> dict:
    """Parameter bytes of the model (``dtype`` weights if ``recipe`` is None, else fp8 weights built
    from a ``dtype`` model), and the total with the masters (fp8 weights only) and AdamW's state."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(device) or 0
    model = build(config, recipe, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    labels = {torch.bfloat16: "bf16", torch.float32: "fp32 (bf16 compute: FSDP2 MixedPrecisionPolicy)"}
    label = labels.get(dtype, str(dtype))
    row = {"weights": label if recipe is None else f"fp8 {recipe}", "params": n_params,
           "param_bytes": tensor_bytes(list(model.parameters()) + list(model.buffers()))}
    if cuda:
        row["cuda_param_bytes"] = _allocated(device) - base
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    trained = f8.nn.MasterWeights(model) if recipe is not None else model
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    for p in trained.parameters():  # one step on zero gradients creates AdamW's state
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    row["train_bytes"] = tensor_bytes(list(model.parameters()) + list(model.buffers())
                                      + list(trained.parameters()) + state)
    if cuda:
        row["cuda_train_bytes"] = _allocated(device) - base
    del model, trained, opt, state
    return row


def run(iters: int = 0, recipes=RECIPES, config: dict = LLAMA_1B, device: str = "cuda") -> list[dict]:
    """bf16 weights, fp32 weights (the usual master weights of bf16 training), then fp8 weights
    for each recipe (``iters`` is unused: nothing is timed)."""
    rows = []
    for recipe, dtype in [(None, torch.bfloat16), (None, torch.float32)] + [(r, torch.bfloat16) for r in recipes]:
        row = measure(recipe, config, device, dtype)
        rows.append(row)
        print(row, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    gib = 2 ** 30
    bf16 = rows[0]
    cuda = "cuda_param_bytes" in bf16
    head = "| weights | params | param GiB | vs bf16 | bytes/param | + masters + AdamW GiB |"
    head += " CUDA allocated GiB (params / peak at init / + masters + AdamW) |" if cuda else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['weights']} | {r['params'] / 1e9:.3f}B | {r['param_bytes'] / gib:.3f} | "
                f"{r['param_bytes'] / bf16['param_bytes']:.2f}x | {r['param_bytes'] / r['params']:.2f} | "
                f"{r['train_bytes'] / gib:.3f} |")
        if cuda:
            line += (f" {r['cuda_param_bytes'] / gib:.3f} / {r['cuda_peak_bytes'] / gib:.3f} / "
                     f"{r['cuda_train_bytes'] / gib:.3f} |")
        lines.append(line)
    return "\n".join(lines)
