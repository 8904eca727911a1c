"""The parameter sets of bench_muon.py: which tensors a model has and which go to Muon.

A set is a list of ``TensorSpec`` (name, shape, optimizer). The GPT sets are the params of
launch_scripts/train/gpt.py's ``GPT`` (fused qkv, no linear biases, LayerNorm weight and bias,
the head tied to the token embedding); the Llama set is decoder layers of Llama-3-8B's shape
(GQA: 8 kv heads of 128; RMSNorm weights; no embeddings). 2-D hidden weights go to Muon, the
embeddings and 1-D params to AdamW, as ``shardopt.muon_param_groups`` splits a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

MUON = "muon"
ADAMW = "adamw"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One param: its name in the model, its shape and the optimizer that takes it."""

    name: str
    shape: tuple[int, ...]
    optimizer: str


def gpt_specs(vocab: int, block: int, d: int, layers: int) -> list[TensorSpec]:
    """gpt.py's ``GPT`` params in ``named_parameters()`` order (the tied head once, as wte)."""
    specs = [
        TensorSpec("wte.weight", (vocab, d), ADAMW),
        TensorSpec("wpe.weight", (block, d), ADAMW),
    ]
    for i in range(layers):
        b = f"blocks.{i}"
        specs += [
            TensorSpec(f"{b}.ln_1.weight", (d,), ADAMW),
            TensorSpec(f"{b}.ln_1.bias", (d,), ADAMW),
            TensorSpec(f"{b}.attn.qkv.weight", (3 * d, d), MUON),
            TensorSpec(f"{b}.attn.proj.weight", (d, d), MUON),
            TensorSpec(f"{b}.ln_2.weight", (d,), ADAMW),
            TensorSpec(f"{b}.ln_2.bias", (d,), ADAMW),
            TensorSpec(f"{b}.mlp.fc.weight", (4 * d, d), MUON),
            TensorSpec(f"{b}.mlp.proj.weight", (d, 4 * d), MUON),
        ]
    specs += [TensorSpec("ln_f.weight", (d,), ADAMW), TensorSpec("ln_f.bias", (d,), ADAMW)]
    return specs


def llama_specs(layers: int, d: int, ffn: int, kv_heads: int, head_dim: int) -> list[TensorSpec]:
    """Llama decoder layers (Hugging Face's names): q/k/v/o, gate/up/down, two RMSNorms."""
    kv = kv_heads * head_dim
    specs = []
    for i in range(layers):
        b = f"layers.{i}"
        specs += [
            TensorSpec(f"{b}.self_attn.q_proj.weight", (d, d), MUON),
            TensorSpec(f"{b}.self_attn.k_proj.weight", (kv, d), MUON),
            TensorSpec(f"{b}.self_attn.v_proj.weight", (kv, d), MUON),
            TensorSpec(f"{b}.self_attn.o_proj.weight", (d, d), MUON),
            TensorSpec(f"{b}.mlp.gate_proj.weight", (ffn, d), MUON),
            TensorSpec(f"{b}.mlp.up_proj.weight", (ffn, d), MUON),
            TensorSpec(f"{b}.mlp.down_proj.weight", (d, ffn), MUON),
            TensorSpec(f"{b}.input_layernorm.weight", (d,), ADAMW),
            TensorSpec(f"{b}.post_attention_layernorm.weight", (d,), ADAMW),
        ]
    return specs


#: full-size sets: the 124M GPT (gpt.py's "gpt2" preset), the 1.3B GPT ("1.4b" preset: 24 layers,
#: d=2048, 1.31B params with embeddings) and Llama-8B-shaped layers (``layers`` of them)
SETS: dict[str, Callable[[int], list[TensorSpec]]] = {
    "gpt124m": lambda layers: gpt_specs(vocab=50304, block=1024, d=768, layers=12),
    "gpt1.3b": lambda layers: gpt_specs(vocab=50304, block=2048, d=2048, layers=24),
    "llama8b": lambda layers: llama_specs(layers, d=4096, ffn=14336, kv_heads=8, head_dim=128),
}

#: the same structure at toy sizes, for ``--tiny`` (seconds on a CPU)
TINY_SETS: dict[str, Callable[[int], list[TensorSpec]]] = {
    "gpt124m": lambda layers: gpt_specs(vocab=256, block=32, d=32, layers=2),
    "gpt1.3b": lambda layers: gpt_specs(vocab=256, block=64, d=64, layers=2),
    "llama8b": lambda layers: llama_specs(layers, d=64, ffn=224, kv_heads=2, head_dim=16),
}


def set_specs(name: str, tiny: bool, llama_layers: int) -> list[TensorSpec]:
    """The specs of set ``name`` (full size, or toy sizes with ``tiny``)."""
    return (TINY_SETS if tiny else SETS)[name](llama_layers)


def make_params(
    specs: list[TensorSpec], device: torch.device, seed: int = 0
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """fp32 params with preallocated random grads: ``(muon_params, adamw_params)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    muon, adamw = [], []
    for spec in specs:
        p = torch.nn.Parameter(
            torch.randn(spec.shape, generator=gen, device=device).mul_(0.02), requires_grad=True
        )
        p.grad = torch.randn(spec.shape, generator=gen, device=device)
        (muon if spec.optimizer == MUON else adamw).append(p)
    return muon, adamw


def matrix_stacks(specs: list[TensorSpec]) -> list[tuple[int, int, int]]:
    """``[(count, rows, cols), ...]``: the Muon matrices by shape, in order of first appearance
    (the batches FusedMuon orthogonalizes together)."""
    counts: dict[tuple[int, int], int] = {}
    for spec in specs:
        if spec.optimizer == MUON:
            key = (spec.shape[-2], spec.shape[-1])
            counts[key] = counts.get(key, 0) + math.prod(spec.shape[:-2])
    return [(count, rows, cols) for (rows, cols), count in counts.items()]


def ns_flops(stacks: list[tuple[int, int, int]], ns_steps: int = 5) -> float:
    """Newton-Schulz FLOPs: ``(20 n²m + 10 n³) * ns_steps / 5`` per n x m matrix, n <= m
    (per step ``X Xᵀ``, ``A²`` and ``B X``; 2 FLOPs per multiply-add)."""
    total = 0.0
    for count, rows, cols in stacks:
        n, m = min(rows, cols), max(rows, cols)
        total += count * (20.0 * n * n * m + 10.0 * n**3) * ns_steps / 5
    return total


def describe(specs: list[TensorSpec]) -> dict[str, int]:
    """Element and tensor counts of a set, for the report."""
    muon = [s for s in specs if s.optimizer == MUON]
    return {
        "numel": sum(math.prod(s.shape) for s in specs),
        "muon_numel": sum(math.prod(s.shape) for s in muon),
        "tensors": len(specs),
        "muon_tensors": len(muon),
    }


def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the first and last of ``params``: ``moved`` tells whether a step changed them."""
    return [params[0].detach().clone(), params[-1].detach().clone()] if params else []


def moved(params: list[torch.Tensor], before: list[torch.Tensor]) -> float | None:
    """The smaller relative change ``|p - before| / |before|`` of the snapshot's two params: 0
    means an optimizer that left a Muon matrix alone (a contender timed doing nothing)."""
    if not before:
        return None
    now = [params[0].detach(), params[-1].detach()]
    changes = [float((p - b).norm() / b.norm().clamp(min=1e-30)) for p, b in zip(now, before)]
    return min(changes)
