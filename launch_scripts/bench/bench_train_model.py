"""The benchmark GPT of bench_train.py (pre-LN blocks, tied embeddings) and its parameter count."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

# -- model ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, time, channels))
        return x + self.fc2(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Decoder-only language model with untied embeddings; ``forward`` returns the mean loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def count_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())
