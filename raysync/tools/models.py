"""Parameter layouts of real models (shapes only: nothing is downloaded) and a tiny model made locally.

Used by the benchmarks, the demo and the tests. The layouts follow the published configs of the Qwen2.5
family (Qwen2 architecture: q/k/v projections with bias, SwiGLU MLP, RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Qwen2Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                (p + "mlp.up_proj.weight", (self.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, self.intermediate)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out


LAYOUTS: dict[str, Qwen2Shape] = {
    "qwen2.5-0.5b": Qwen2Shape(896, 4864, 24, 14, 2, 151936, tied=True),
    "qwen2.5-1.5b": Qwen2Shape(1536, 8960, 28, 12, 2, 151936, tied=True),
    "qwen2.5-7b": Qwen2Shape(3584, 18944, 28, 28, 4, 152064, tied=False),
    "qwen2-tiny": Qwen2Shape(128, 256, 2, 4, 2, 512, tied=False),  # tiny_qwen2()'s shapes, for quick runs
}


def allocate(
    layout: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", fill: bool = True
) -> dict[str, torch.Tensor]:
    """Tensors of ``layout``'s shapes (filled with a cheap pattern so pages are really touched)."""
    out = {}
    for i, (name, shape) in enumerate(LAYOUTS[layout].named_shapes()):
        t = torch.empty(shape, dtype=dtype, device=device)
        if fill:
            t.fill_(i % 7 + 1)
        out[name] = t
    return out


def tiny_qwen2(seed: int, *, hidden: int = 128, layers: int = 2, vocab: int = 512, tied: bool = False):
    """A small Qwen2ForCausalLM with random weights (transformers), made locally. The CPU attention of vLLM
    needs head_dim >= 32: 4 heads of 32 for hidden=128. ``tied``: the output head is the embedding
    (``tie_word_embeddings``, as in Qwen2.5-0.5B/1.5B/3B and Llama-3.2-1B/3B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def describe(model: torch.nn.Module) -> str:
    """One line saying which model this is: architecture, layers, hidden size, vocabulary, whether the output
    head is the embedding, and the parameter count (tied tensors counted once, as in named_parameters)."""
    count = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} (torch), {count / 1e6:.2f}M parameters"
    tied = "tied to the embedding" if config.tie_word_embeddings else "its own tensor"
    return (
        f"{type(model).__name__}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}, output head {tied}, {count / 1e6:.2f}M parameters"
    )
