"""bench_train.py's modes: how each way of training (DDP, FSDP2, DeepSpeed, shardopt's
optimizers and storage formats) is set up on the model, and how a mode's optimizer is released."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_train_collectives import engine_bucket_cap_mb
from bench_train_env import WEIGHT_DECAY, shardopt
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# -- modes ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """What one mode trains: the module to call, the optimizer, and its settings for the record."""

    forward: nn.Module
    opt: torch.optim.Optimizer
    settings: dict[str, Any]
    #: a framework's own backward and step (DeepSpeed's engine), else loss.backward(), opt.step()
    backward: Callable[[torch.Tensor], None] | None = None
    step: Callable[[], None] | None = None


def wrap_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def setup_ddp_adamw(model, device, args) -> Setup:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True)
    return Setup(wrap_ddp(model, device), opt, {"ddp_bucket_cap_mb": 25, "fused": True})


def setup_ddp_zero(model, device, args) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = wrap_ddp(model, device)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=args.lr,
        weight_decay=WEIGHT_DECAY,
        fused=True,
    )
    return Setup(wrapped, opt, {"ddp_bucket_cap_mb": 25, "fused": True})


def setup_fsdp2(model, device, args) -> Setup:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, fused=True)
    return Setup(model, opt, {"reshard_after_forward": False, "fused": True})


def _shardopt(cls_name: str, model, args, bucket_scale: float = 1.0, **flags) -> Setup:
    zero_args = dict(flags)
    zero_args["bucket_cap_mb"] = bucket_scale * (args.bucket_cap_mb or engine_bucket_cap_mb())
    cls = getattr(shardopt, cls_name)
    opt = cls(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY, **zero_args)
    return Setup(model, opt, shardopt_settings(opt))


def shardopt_settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A shardopt mode's engine settings, for the record."""
    return {
        "bucket_cap_mb": opt.bucket_cap_mb,
        "overlap_grad_sync": opt.overlap_grad_sync,
        "overlap_param_sync": opt.overlap_param_sync,
    }


def setup_shardopt_adam(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=False, overlap_param_sync=False
    )


def setup_shardopt_adam_overlap(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=True
    )


def setup_shardopt_adam_overlap_big(model, device, args) -> Setup:
    return _shardopt(
        "DistributedFusedAdam",
        model,
        args,
        bucket_scale=BIG_BUCKET_SCALE,
        overlap_grad_sync=True,
        overlap_param_sync=True,
    )


def setup_shardopt_adam_graph(model, device, args) -> Setup:
    if device.type != "cuda":
        raise RuntimeError("shardopt_adam_graph needs CUDA (it replays a CUDA graph)")
    setup = _shardopt(
        "DistributedFusedAdam",
        model,
        args,
        capturable=True,
        overlap_grad_sync=True,
        overlap_param_sync=False,
    )
    setup.settings["cuda_graph"] = True
    return setup


def _compact(model, args, params_bf16: bool, **storage) -> Setup:
    """Adam with grad and param overlap over compact storage (README: memory per parameter)."""
    if params_bf16:
        model.to(torch.bfloat16)
    setup = _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=True,
        **storage,
    )  # fmt: skip
    setup.settings.update(storage, params="bf16" if params_bf16 else "fp32")
    return setup


def setup_shardopt_adam_scaled(model, device, args) -> Setup:
    return _compact(model, args, False, with_scaled_states=True)


def setup_shardopt_adam_int8(model, device, args) -> Setup:
    return _compact(model, args, False, state_format="int8")


def setup_shardopt_adam_bf16(model, device, args) -> Setup:
    return _compact(model, args, True)


def setup_shardopt_adam_bf16_remainders(model, device, args) -> Setup:
    return _compact(model, args, True, store_param_remainders=True)


def setup_shardopt_adam_bf16_remainders_int8(model, device, args) -> Setup:
    return _compact(model, args, True, store_param_remainders=True, state_format="int8")


def setup_deepspeed_zero2(model, device, args) -> Setup:
    """DeepSpeed ZeRO stage 2 (sharded optimizer state and grads), its fused AdamW, overlapped
    reduce-scatter, 500 MB buckets (its recommended large-model settings); bf16 autocast as the
    other modes, fp32 params."""
    import deepspeed

    config = deepspeed_zero2_config(args, "AdamW")
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    return Setup(
        engine,
        opt,
        {"deepspeed": deepspeed.__version__, "zero_stage": 2, "bucket_bytes": 5e8},
        backward=engine.backward,
        step=engine.step,
    )


def deepspeed_zero2_config(args, optimizer: str) -> dict[str, Any]:
    """The DeepSpeed config of the ZeRO-2 modes: ``optimizer`` ("AdamW", "muon") with the bench's
    lr and weight decay, overlapped reduce-scatter, 500 MB buckets, bf16 autocast."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": optimizer, "params": {"lr": args.lr, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "gradient_clipping": 0.0,
        # bf16 autocast inside the engine too (else it disables the caller's: fp32 compute)
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def setup_ddp_adamw_compiled(model, device, args) -> Setup:
    setup = setup_ddp_adamw(model, device, args)
    setup.forward = torch.compile(setup.forward)
    setup.settings["compiled"] = True
    return setup


def setup_shardopt_adam_compiled(model, device, args) -> Setup:
    """torch.compile'd model; grad overlap (param sync waits in step(): no forward hooks)."""
    setup = _shardopt(
        "DistributedFusedAdam", model, args, overlap_grad_sync=True, overlap_param_sync=False
    )
    setup.forward = torch.compile(model)
    setup.settings["compiled"] = True
    return setup


def setup_shardopt_lamb(model, device, args) -> Setup:
    return _shardopt("DistributedFusedLAMB", model, args)


class _NoStep(torch.optim.Optimizer):
    """compute_floor's optimizer: drops the grads, updates nothing."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self, closure=None):  # noqa: D102
        return None


def setup_compute_floor(model, device, args) -> Setup:
    """The same forward and backward on each GPU alone: no communication, no optimizer."""
    return Setup(model, _NoStep(model.parameters()), {"floor": True})


MODES: dict[str, Callable[[nn.Module, torch.device, argparse.Namespace], Setup]] = {
    "compute_floor": setup_compute_floor,
    "ddp_adamw": setup_ddp_adamw,
    "ddp_zero": setup_ddp_zero,
    "fsdp2": setup_fsdp2,
    "shardopt_adam": setup_shardopt_adam,
    "shardopt_adam_overlap": setup_shardopt_adam_overlap,
    "shardopt_adam_overlap_big": setup_shardopt_adam_overlap_big,
    "shardopt_adam_graph": setup_shardopt_adam_graph,
    "shardopt_lamb": setup_shardopt_lamb,
}
DEFAULT_MODES = list(MODES)
# peers and variants run when --modes names them: DeepSpeed (not installed by default), compiled
MODES.update(
    deepspeed_zero2=setup_deepspeed_zero2,
    ddp_adamw_compiled=setup_ddp_adamw_compiled,
    shardopt_adam_compiled=setup_shardopt_adam_compiled,
)
# compact storage (README: memory per parameter), run when --modes names them
MODES.update(
    shardopt_adam_scaled=setup_shardopt_adam_scaled,
    shardopt_adam_int8=setup_shardopt_adam_int8,
    shardopt_adam_bf16=setup_shardopt_adam_bf16,
    shardopt_adam_bf16_remainders=setup_shardopt_adam_bf16_remainders,
    shardopt_adam_bf16_remainders_int8=setup_shardopt_adam_bf16_remainders_int8,
)
BIG_BUCKET_SCALE = 4  # shardopt_adam_overlap_big: buckets of 4x the bucket cap


def release(opt: torch.optim.Optimizer | None) -> None:
    """Lets a shardopt optimizer be freed: drains its param sync, removes its grad hooks.

    With ``overlap_param_sync`` the all-gathers are waited for in a global module forward
    pre-hook, so any module call finishes them. The engine's post-accumulate-grad hooks (bound
    methods of the optimizer, stored on the params it holds) form a cycle through the tensors
    that ``gc`` does not collect: without removing them, each shardopt mode would keep its model,
    buffers and state alive into the next mode.
    """
    if opt is None or not hasattr(opt, "overlap_param_sync"):
        return
    nn.Identity()(torch.zeros(()))
    opt.close()
