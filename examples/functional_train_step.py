"""A functional FP8 train step: ``fp8func.nn.apply`` + ``torch.func.grad``, compiled, and vmapped over an ensemble.

The model is an ordinary HF Qwen3 (built from a config) converted with ``recipe="delayed"``.
Nothing in the step mutates anything: parameters and the delayed-scaling states of every layer
go in, new ones come out, as in JAX. The next states are the gradients of the state inputs
("overwrite with gradient", as flax's fp8 ops), so one ``grad`` gives both.

    python examples/functional_train_step.py --steps 20
    python examples/functional_train_step.py --steps 5 --ensemble 4     # vmap over 4 members
"""

from __future__ import annotations

import argparse

import torch
from torch.func import grad, stack_module_state, vmap

import fp8func as f8


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def make_step(model, lr: float):
    """``step(params, states, ids) -> (params, states, loss)``: pure, SGD."""

    def loss_fn(params, states, ids):
        out, _ = f8.nn.apply(model, params, states, input_ids=ids, labels=ids)
        return out.loss, out.loss.detach()

    def step(params, states, ids):
        (g_params, g_states), loss = grad(loss_fn, argnums=(0, 1), has_aux=True)(params, states, ids)
        new_params = {k: p - lr * g_params[k] for k, p in params.items()}
        return new_params, f8.nn.next_states(states, g_states), loss

    return step


def batch(i: int, members: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, ((members,) if members else ()) + (4, 64), generator=g)


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compile", action="store_true", help="torch.compile the whole step (fullgraph)")
    p.add_argument("--ensemble", type=int, default=0, help="train this many members at once with vmap")
    args = p.parse_args(argv)
    model = f8.convert(tiny_qwen3(), "delayed")
    step = make_step(model, args.lr)
    if args.ensemble:
        members = [f8.convert(tiny_qwen3(seed=s), "delayed") for s in range(args.ensemble)]
        params, _ = stack_module_state(members)
        states = {k: torch.stack([f8.nn.scaling_states(m)[k] for m in members]) for k in f8.nn.scaling_states(model)}
        step = vmap(step)
    else:
        params = {k: v.detach() for k, v in model.named_parameters()}
        states = f8.nn.scaling_states(model)
    if args.compile:
        step = torch.compile(step, fullgraph=True)
    losses = []
    for i in range(args.steps):
        params, states, loss = step(params, states, batch(i, args.ensemble))
        losses.append(loss.tolist())
        amax = states["model.layers.0.self_attn.q_proj.fp8_dy_history"][..., 0]
        print(f"step {i:3d}  loss {loss.tolist()}  q_proj grad_output amax {amax.tolist()}")
    return losses


if __name__ == "__main__":
    main()
