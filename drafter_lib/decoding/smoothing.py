"""SmoothQuant-style smoothing before W8A8: move the activations' outlier channels into the weights.

An RMSNorm output has a few channels far larger than the rest (the norm's weight amplifies them), so one int8 scale
per row spends its range on them and rounds the others to a few levels. For the products that read a norm's output
(q/k/v after `input_layernorm`, gate/up after `post_attention_layernorm`) and the one that reads up's output
(down_proj), channel j is divided by s_j before it is quantized and the weights' column j multiplied by it, which
leaves the float product unchanged: s_j = max|x_j|^alpha / max|W_.j|^(1 - alpha) (Xiao et al., SmoothQuant, 2022),
the activation maxima measured once on calibration text. The division is folded into the norm's weight (or up_proj's
rows), so a smoothed model runs exactly as many operations as before.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from drafter_lib.model.transformer import Transformer

# teacher-forced top-1 agreement with fp32 (SmolLM2-135M, 7-bit rows): 0.83 / 0.89 / 0.91 / 0.90 at none / 0.5 /
# 0.7 / 0.85
ALPHA = 0.7
# Calibration text: prose, dialogue, code, math and lists, so that every kind of channel outlier shows up.
CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type with an oil-based ink and a screw press adapted from wine making.",
    "User: Can you help me plan a three-day trip to Lisbon on a small budget?\nAssistant: Of course! Day one: walk "
    "through Alfama, take tram 28 and watch the sunset from a miradouro.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Solve for x: 3x + 7 = 22. Subtract 7 from both sides to get 3x = 15, then divide by 3, so x = 5. Check: "
    "3 * 5 + 7 = 22.",
    "Ingredients:\n- 2 cups flour\n- 1 tsp baking soda\n- 3 eggs\n1. Preheat the oven to 180 C.\n2. Whisk the eggs.",
    "Photosynthesis converts light energy into chemical energy: carbon dioxide and water become glucose and oxygen "
    "inside the chloroplasts of plant cells.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id GROUP BY name;",
    "Dear team, thank you all for the hard work this quarter. Our results exceeded expectations, and I would like "
    "to invite everyone to a celebration on Friday.",
)


@torch.inference_mode()
def activation_maxima(model: Transformer, token_rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Per-channel max |x| of the inputs of each layer's q/k/v ("L.attn"), gate/up ("L.mlp") and down ("L.down")
    products over `token_rows` (each run alone from position 0, no cache)."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        seen[name] = m if name not in seen else torch.maximum(seen[name], m)

    def output_of(name):
        return lambda _module, _args, output: record(name, output)

    def input_of(name):
        return lambda _module, args: record(name, args[0])

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.input_layernorm.register_forward_hook(output_of(f"{i}.attn")))
        handles.append(layer.post_attention_layernorm.register_forward_hook(output_of(f"{i}.mlp")))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(input_of(f"{i}.down")))
    try:
        for row in token_rows:
            ids = torch.tensor([list(row)], dtype=torch.long)
            model.hidden(ids, torch.arange(ids.shape[1])[None])
    finally:
        for h in handles:
            h.remove()
    return seen


def _factors(act_max: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.stack([w.detach().abs().amax(0) for w in weights]).amax(0).float()
    s = act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp_min(1e-5)


@torch.no_grad()
def smooth(model: Transformer, token_rows: Sequence[Sequence[int]], alpha: float = ALPHA) -> dict:
    """Smooth `model` (fp32, its linears not yet quantized) in place from the activations of `token_rows`. Returns
    {"alpha", "tokens"}. The float model's outputs change only by rounding."""
    if not token_rows:
        raise ValueError("smoothing needs calibration tokens")
    act = activation_maxima(model, token_rows)
    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        for norm, lins, key in ((layer.input_layernorm, [att.q_proj, att.k_proj, att.v_proj], "attn"),
                                (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp")):
            s = _factors(act[f"{i}.{key}"], [lin.weight for lin in lins], alpha)
            norm.weight.div_(s)
            for lin in lins:  # (x / s) @ (W * s)^T = x @ W^T: a bias (Qwen2's q/k/v) adds after it, unchanged
                lin.weight.mul_(s)
        s = _factors(act[f"{i}.down"], [mlp.down_proj.weight], alpha)
        mlp.up_proj.weight.div_(s[:, None])  # up's output channel j feeds down's column j (through silu(gate) * up)
        if mlp.up_proj.bias is not None:
            mlp.up_proj.bias.div_(s)
        mlp.down_proj.weight.mul_(s)
    return dict(alpha=alpha, tokens=sum(len(r) for r in token_rows))


def calibration_rows(tokenizer) -> list[list[int]]:
    """CALIBRATION_TEXTS as token ids (no special tokens)."""
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in CALIBRATION_TEXTS]
