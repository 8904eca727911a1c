"""bench_train.py's Muon modes, run when --modes names them: Muon on the hidden matrices and
AdamW on the rest, split as ``shardopt.muon_param_groups`` splits the model (the embeddings and
the output head to AdamW), one lr for both parts (Muon's ``adjust_lr_fn="match_rms_adamw"``,
torch's and shardopt's; DeepSpeed has no such option), weight decay 0.1 everywhere:

  ddp_muon              DDP + torch.optim.Muon on the matrices + torch.optim.AdamW(fused=True)
                        on the rest: every rank orthogonalizes every matrix
  shardopt_muon         DistributedFusedMuon (grad and param overlap): each matrix
                        orthogonalized once, whole, by the rank that owns it
  deepspeed_zero2_muon  DeepSpeed ZeRO-2 with its "muon" optimizer (its AdamW part is its own);
                        the params tagged with the same split (DeepSpeed's own rule, 2-D and
                        not named embed/lm_head, would send this GPT's wte and wpe to Muon)

megatron-core's layer-wise optimizer is not a mode: it needs Megatron's model-parallel state and
its own model classes, not a plain torch module under torchrun.
"""

from __future__ import annotations

from typing import Any

import torch
from bench_train_collectives import engine_bucket_cap_mb
from bench_train_env import WEIGHT_DECAY, shardopt
from bench_train_modes import Setup, deepspeed_zero2_config, shardopt_settings, wrap_ddp
from torch import nn

#: Muon's shape scale in every mode that has one: the update's RMS matched to AdamW's
ADJUST_LR_FN = "match_rms_adamw"


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's params, AdamW's params) of ``model``, as ``shardopt.muon_param_groups``."""
    groups = shardopt.muon_param_groups(model)
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    adamw = [p for g in groups if not g["use_muon"] for p in g["params"]]
    return muon, adamw


class MuonAndAdamW:
    """torch.optim.Muon and torch.optim.AdamW stepped as one optimizer (the bench's step and
    zero_grad), the way scripts pair them."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)
        self.param_groups = [g for o in self.parts for g in o.param_groups]

    def step(self, closure: Any = None) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)


def setup_ddp_muon(model, device, args) -> Setup:
    muon_params, adamw_params = split(model)
    wrapped = wrap_ddp(model, device)
    muon = torch.optim.Muon(
        muon_params, lr=args.lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn=ADJUST_LR_FN
    )
    adamw = torch.optim.AdamW(adamw_params, lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True)
    settings = {"ddp_bucket_cap_mb": 25, "adjust_lr_fn": ADJUST_LR_FN, "fused_adamw": True}
    return Setup(wrapped, MuonAndAdamW(muon, adamw), settings)


def setup_shardopt_muon(model, device, args) -> Setup:
    groups = shardopt.muon_param_groups(model, adamw_lr=args.lr, adamw_weight_decay=WEIGHT_DECAY)
    opt = shardopt.DistributedFusedMuon(
        groups,
        lr=args.lr,
        weight_decay=WEIGHT_DECAY,
        adjust_lr_fn=ADJUST_LR_FN,
        bucket_cap_mb=args.bucket_cap_mb or engine_bucket_cap_mb(),
        overlap_grad_sync=True,
        overlap_param_sync=True,
    )
    return Setup(model, opt, {**shardopt_settings(opt), "adjust_lr_fn": ADJUST_LR_FN})


def setup_deepspeed_zero2_muon(model, device, args) -> Setup:
    """DeepSpeed ZeRO-2, ``"type": "muon"``, its other settings as deepspeed_zero2's."""
    import deepspeed

    muon_params, _ = split(model)
    chosen = {id(p) for p in muon_params}

    def tag_as_the_other_modes(config_class: Any, module: nn.Module) -> None:
        for p in module.parameters():
            p.use_muon = id(p) in chosen

    config = deepspeed_zero2_config(args, "muon")
    own_rule = getattr(deepspeed, "set_optimizer_flags", None)
    if own_rule is None:
        raise RuntimeError(
            f"deepspeed {deepspeed.__version__} has no set_optimizer_flags: its Muon split "
            "cannot be set to the other modes' split"
        )
    deepspeed.set_optimizer_flags = tag_as_the_other_modes
    try:
        engine, opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config,
            dist_init_required=False,
        )  # fmt: skip
    finally:
        deepspeed.set_optimizer_flags = own_rule
    settings = {"deepspeed": deepspeed.__version__, "zero_stage": 2, "optimizer": "muon"}
    return Setup(engine, opt, settings, backward=engine.backward, step=engine.step)


MUON_MODES = {
    "ddp_muon": setup_ddp_muon,
    "shardopt_muon": setup_shardopt_muon,
    "deepspeed_zero2_muon": setup_deepspeed_zero2_muon,
}
