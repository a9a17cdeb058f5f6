"""A small decoder-only transformer (GPT) for byte-level language modelling.

Pre-LayerNorm blocks (x + attention(norm(x)), then x + MLP(norm(x))), causal self-attention
through ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` with one fused
query-key-value projection, a GELU MLP of 4x the width, token and learned position embeddings,
and an output projection tied to the token embedding (one tensor, counted once).

Initialisation as GPT-2's: every Linear and Embedding weight normal(0, 0.02), biases zero, and
the two projections that write into the residual stream in each block (attention's ``proj``, the
MLP's ``proj``) normal(0, 0.02 / sqrt(2 * layers)), so the residual stream's variance does not
grow with depth.

Its sizes are a :class:`GPTConfig`; :func:`config_for` reads them from a profile (the ``gpt_*``
rows of ``utils/config.py``). Its parameter count has a closed form (:func:`parameter_count`);
its FLOPs are in ``utils.flops`` (``gpt_flops_per_token``) and its memory in ``utils.memory``
(``gpt_memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "config_for", "parameter_count", "CausalSelfAttention", "MLP", "Block", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`. ``width`` is d_model; each of the ``heads`` attention heads
    has ``width // heads`` dimensions."""

    vocab_size: int = 256  # bytes: no tokenizer needed
    context: int = 256  # longest sequence (tokens); the position embedding has this many rows
    width: int = 128  # d_model
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads; must divide width
    dropout: float = 0.0  # after the embeddings, on attention weights, after each residual branch
    bias: bool = True  # biases in the Linear layers and LayerNorms

    def __post_init__(self):
        for name in ("vocab_size", "context", "width", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"GPTConfig: heads ({self.heads}) must divide width ({self.width})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_width(self) -> int:
        return self.width // self.heads


def config_for(cfg: Any, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a profile (``utils.config.profile()``): rows ``gpt_context``,
    ``gpt_width``, ``gpt_layers``, ``gpt_heads``; ``overrides`` replace single fields."""
    sizes = {
        "context": cfg.gpt_context,
        "width": cfg.gpt_width,
        "layers": cfg.gpt_layers,
        "heads": cfg.gpt_heads,
    }
    return GPTConfig(**{**sizes, **overrides})


def parameter_count(cfg: GPTConfig, *, embeddings: bool = True) -> int:
    """Parameters of ``GPT(cfg)`` in closed form (the tied output projection counted once, as the
    token embedding). With ``d = width``, per block: two LayerNorms (2d each, d without bias),
    QKV 3d^2 (+3d), attention projection d^2 (+d), MLP 4d^2 (+4d) and 4d^2 (+d): 12d^2 + 13d
    with biases, 12d^2 + 2d without. Then the final LayerNorm, and with ``embeddings`` the token
    (vocab x d) and position (context x d) tables."""
    d = cfg.width
    norm = 2 * d if cfg.bias else d
    block = 12 * d * d + 2 * norm + (9 * d if cfg.bias else 0)
    total = cfg.layers * block + norm
    if embeddings:
        total += (cfg.vocab_size + cfg.context) * d
    return total


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one Linear makes queries, keys and values for every head,
    PyTorch's fused attention (``is_causal=True``: position t sees positions <= t) mixes them,
    one Linear projects the heads back into the residual stream."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.out_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> (3, b, heads, t, head_width): q, k, v for every head, views of one tensor
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, d // self.heads)).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (b, heads, t, head_width)
        y = y.transpose(1, 2).reshape(b, t, d)  # heads side by side again
        return self.out_dropout(self.proj(y))


class MLP(nn.Module):
    """Linear(d, 4d), GELU, Linear(4d, d): the position-wise half of a block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)
        self.out_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: each branch reads a normalised copy of the residual
    stream and adds its output back to it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids (batch, t) in, next-token logits (batch, t, vocab) out.

    ``forward(idx, targets=None)`` returns ``(logits, loss)``: ``loss`` is the mean cross-entropy
    of every position's prediction against ``targets`` (the ids shifted by one), None without
    targets. ``head.weight`` is ``tok.weight``: the output projection and the token embedding are
    one tensor."""

    def __init__(self, cfg: GPTConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.in_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's initialisation (module docstring); ``seed``: from a generator seeded with it
        (same seed, same weights), else from the global RNG."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and m is not self.head:  # head: the token table
                std = residual_std if name.endswith(".proj") else 0.02
                w = torch.empty(m.weight.shape).normal_(0.0, std, generator=g)
                m.weight.copy_(w)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"GPT: a sequence of {t} tokens is longer than the context ({self.cfg.context})")
        positions = torch.arange(t, device=idx.device)
        x = self.in_dropout(self.tok(idx) + self.pos(positions))  # (b, t, d)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (b, t, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``idx`` (b, t) followed by ``new_tokens`` sampled one at a time, each from the softmax
        of the last position's logits / ``temperature`` (0: the most likely token). The model
        sees at most its last ``context`` tokens."""
        if temperature < 0:
            raise ValueError(
                f"generate: temperature must be >= 0, got {temperature}. Try: 1.0, or 0 for the most likely token."
            )
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.cfg.context :])
            last = logits[:, -1]
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                probs = F.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
