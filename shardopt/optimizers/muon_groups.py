"""``muon_param_groups``: the usual split of a model between Muon and AdamW, as param groups of
one ``FusedMuon``.

Note: which params Muon takes
Muon orthogonalizes the update of a hidden layer's weight matrix; an embedding (rows looked up,
not multiplied), the output head (its rows are the vocabulary) and 1-D params (norms, biases)
have no such structure and are trained with AdamW (Keller Jordan's Muon, Moonlight, every
speedrun record). Shapes alone cannot tell an untied head or an embedding from a hidden matrix,
so the rules look at the modules, and names override them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

#: modules whose params are looked up, not multiplied: AdamW
EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
#: modules whose weight is one (out, in * kernel) matrix: Muon with ``flatten=True``
CONVS = (torch.nn.modules.conv._ConvNd,)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _head_params(model: torch.nn.Module, head: str | None) -> set[int]:
    """ids of the output head's params: module ``head``, or with "auto" the last ``nn.Linear``
    of ``model.named_modules()`` (where models register their head)."""
    if head is None:
        return set()
    if head == "auto":
        linears = [m for _, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        return {id(p) for p in linears[-1].parameters()} if linears else set()
    return {id(p) for p in model.get_submodule(head).parameters()}


def muon_param_groups(
    model: torch.nn.Module,
    *,
    head: str | None = "auto",
    muon_names: Iterable[str] = (),
    adamw_names: Iterable[str] = (),
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] | None = None,
    adamw_eps: float | None = None,
    adamw_weight_decay: float | None = None,
) -> list[dict[str, Any]]:
    """Param groups of ``FusedMuon`` for ``model``: hidden weight matrices to Muon, the rest to
    AdamW (see Note: which params Muon takes).

    In order, for each trainable param (a tied weight once, under its first name):
    a name matching ``adamw_names`` goes to AdamW and one matching ``muon_names`` to Muon
    (``fnmatch`` patterns on the names of ``model.named_parameters()``); then 0-D and 1-D params,
    the params of ``nn.Embedding``/``nn.EmbeddingBag`` modules (so a head tied to an embedding)
    and the output head's params go to AdamW; conv weights go to a Muon group with
    ``flatten=True`` (one ``(out, in*kh*kw)`` matrix each); every other param (2-D, or a stack of
    matrices over its leading dims) goes to Muon.

    Args:
        model: the model.
        head: the output head's module name; "auto" (default): the last ``nn.Linear`` of
            ``model.named_modules()``; None: no head rule.
        muon_names: patterns of param names forced to Muon.
        adamw_names: patterns of param names forced to AdamW.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW group's hyperparameters;
            None leaves them to ``FusedMuon``'s AdamW defaults (FusedAdam's: lr 1e-3,
            betas (0.9, 0.999), eps 1e-8, weight_decay 0).

    Returns:
        Up to three groups, empty ones left out: ``{"params", "use_muon": True}``, the conv
        weights ``{"params", "use_muon": True, "flatten": True}``, and ``{"params",
        "use_muon": False, ...}``. The Muon groups take ``FusedMuon``'s lr and weight decay.

    Raises:
        ValueError: a name matches both ``muon_names`` and ``adamw_names``.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> opt = shardopt.FusedMuon(muon_param_groups(model, adamw_lr=3e-4), lr=0.02)
        >>> [len(g["params"]) for g in opt.param_groups]
        [1, 3]
    """
    muon_names, adamw_names = tuple(muon_names), tuple(adamw_names)
    embedded = {id(p) for m in model.modules() if isinstance(m, EMBEDDINGS) for p in m.parameters()}
    head_ids = _head_params(model, head)
    conv_weights = {id(m.weight) for m in model.modules() if isinstance(m, CONVS)}
    matrices: list[torch.Tensor] = []
    convs: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        to_adamw, to_muon = _matches(name, adamw_names), _matches(name, muon_names)
        if to_adamw and to_muon:
            raise ValueError(f"{name} matches both muon_names and adamw_names")
        if to_adamw or (not to_muon and (p.ndim < 2 or id(p) in embedded or id(p) in head_ids)):
            others.append(p)
        elif id(p) in conv_weights and p.ndim > 2:
            convs.append(p)
        else:
            matrices.append(p)
    adamw = {
        k: v
        for k, v in (
            ("lr", adamw_lr),
            ("betas", adamw_betas),
            ("eps", adamw_eps),
            ("weight_decay", adamw_weight_decay),
        )
        if v is not None
    }
    groups = [
        {"params": matrices, "use_muon": True},
        {"params": convs, "use_muon": True, "flatten": True},
        {"params": others, "use_muon": False, **adamw},
    ]
    return [g for g in groups if g["params"]]
