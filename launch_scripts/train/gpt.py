"""A small GPT (nanoGPT-style decoder-only transformer) for the training example.

Pre-LayerNorm blocks, causal self-attention through ``F.scaled_dot_product_attention``, GELU MLP,
tied input/output embeddings, no dropout and no biases in the linear layers. The weight init is
GPT-2's: N(0, 0.02), with the residual projections scaled by ``1/sqrt(2 * n_layer)``.

Example:
    >>> model = GPT(GPTConfig.preset("tiny", vocab_size=64))
    >>> tokens = torch.zeros(2, 8, dtype=torch.long)
    >>> logits, loss = model(tokens, targets=tokens)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {
    # Sized so the default CPU run (2 processes on 2 cores) takes about two minutes.
    "tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # nanoGPT's shakespeare_char model.
    "small": dict(block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "1.4b": dict(block_size=2048, n_layer=24, n_head=16, n_embd=2048),
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``vocab_size`` is normally replaced by the corpus's vocabulary size."""

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    @classmethod
    def preset(cls, name: str, **overrides: int) -> GPTConfig:
        """The named preset (``tiny``, ``small``, ``gpt2``, ``1.4b``) with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        config: the model shape.

    ``forward(idx, targets=None)`` takes token ids of shape (batch, time) with time at most
    ``config.block_size`` and returns ``(logits, loss)``; ``loss`` is the mean cross-entropy over
    all positions, or None without targets.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameter count, tied weights counted once, position embeddings included."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups: matrices and embeddings decay, LayerNorm params do not."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self.config.block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
