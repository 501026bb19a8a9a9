"""A functional FP8 train step: ``torch.func.functional_call`` + ``grad``, state threaded explicitly.

The model is an ordinary HF Qwen3 (built from a config) converted with ``recipe="delayed"``.
Nothing in the step mutates anything: parameters, the delayed-scaling states of every layer and
the optimizer state go in, new ones come out, as in JAX. The grad_output scaling states come
back as the gradients of the state inputs ("overwrite with gradient"), the input and weight
states as auxiliary outputs. ``Fp8Linear`` reads its state from its buffers, so a functional
call passes the states as buffers.

    python examples/functional_train_step.py --steps 20
"""

from __future__ import annotations

import argparse

import torch
from torch.func import functional_call, grad

import fp8func as f8


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def split_state(model):
    """(params, scaling states, other buffers) as plain dicts of tensors."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    states = {k: v.detach() for k, v in buffers.items() if ".fp8_" in k}
    others = {k: v for k, v in buffers.items() if ".fp8_" not in k}
    return params, states, others


def make_step(model, lr: float):
    new_fwd = {}

    def record(module, args, kwargs, out):
        # Each Fp8Linear's forward rebinds its input / weight state buffers; functional_call
        # restores the module's own tensors when it returns, so read the new ones here, inside.
        new_fwd.update({k: v.detach() for k, v in module.named_buffers() if ".fp8_x_" in k or ".fp8_w_" in k})

    model.register_forward_hook(record, with_kwargs=True)

    def loss_fn(params, dy_states, fixed_states, others, ids):
        tensors = {**params, **dy_states, **fixed_states, **others}
        out = functional_call(model, tensors, kwargs={"input_ids": ids, "labels": ids})
        return out.loss, (out.loss.detach(), dict(new_fwd))

    def step(params, states, others, ids):
        dy_states = {k: v for k, v in states.items() if ".fp8_dy_" in k}
        fixed = {k: v for k, v in states.items() if ".fp8_dy_" not in k}
        (g_params, g_dy), (loss, new_fwd) = grad(loss_fn, argnums=(0, 1), has_aux=True)(
            params, dy_states, fixed, others, ids)
        new_params = {k: p - lr * g_params[k] for k, p in params.items()}  # plain SGD, functional
        return new_params, {**new_fwd, **g_dy}, loss

    return step


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    model = f8.convert(tiny_qwen3(), "delayed")
    params, states, others = split_state(model)
    step = make_step(model, args.lr)
    losses = []
    for i in range(args.steps):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 256, (4, 64), generator=g)
        params, states, loss = step(params, states, others, ids)
        losses.append(loss.item())
        print(f"step {i:3d}  loss {losses[-1]:.4f}  "
              f"q_proj dy amax {states['model.layers.0.self_attn.q_proj.fp8_dy_history'][0].item():.3e}")
    return losses


if __name__ == "__main__":
    main()
