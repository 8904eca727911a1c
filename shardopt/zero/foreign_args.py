"""Other ZeRO implementations' option names, and where shardopt has each (or why it needs none).

A script ported from DeepSpeed (its ``zero_optimization`` config keys, passed as keywords) or from
torch's ``ZeroRedundancyOptimizer`` gets a ``TypeError`` that names shardopt's counterpart
instead of a bare "unexpected keyword argument". They are refused rather than accepted: an
accepted key that means something else elsewhere would change a run silently. docs/migration.md
("From DeepSpeed", "From ZeroRedundancyOptimizer") has the same table.
"""

from __future__ import annotations

#: option -> (whose, shardopt's counterpart)
COUNTERPARTS: dict[str, tuple[str, str]] = {
    "overlap_comm": ("DeepSpeed", "overlap_grad_sync=True, the default"),
    "contiguous_gradients": (
        "DeepSpeed",
        "nothing to set: grads go through transient per-bucket buffers, never a full-size one",
    ),
    "reduce_bucket_size": ("DeepSpeed", "bucket_cap_mb (MiB of the grad-sync dtype, not elements)"),
    "allgather_bucket_size": (
        "DeepSpeed",
        "bucket_cap_mb (the param all-gathers use the grad buckets' layout)",
    ),
    "reduce_scatter": ("DeepSpeed", "nothing to set: grads are always reduce-scattered"),
    "allgather_partitions": ("DeepSpeed", "nothing to set: params are always all-gathered"),
    "round_robin_gradients": (
        "DeepSpeed",
        "nothing to set: every rank owns a chunk of every bucket, so the reduce work is spread",
    ),
    "stage": ("DeepSpeed", "nothing to set: shardopt is ZeRO-1/2 (stage 3 has no counterpart)"),
    "offload_optimizer": ("DeepSpeed", 'offload="cpu" or offload=shardopt.CPUOffload(...)'),
    "sub_group_size": ("DeepSpeed", "nothing to set: each bucket is updated as one group"),
    "gradient_accumulation_steps": (
        "DeepSpeed",
        "`with opt.no_sync():` around all backward passes but the last, and the loss divided by "
        "the steps yourself (DeepSpeed's engine.backward divides it)",
    ),
    "gradient_clipping": ("DeepSpeed", "opt.clip_grad_norm(max_norm) before opt.step()"),
    "optimizer_class": (
        "torch's ZeroRedundancyOptimizer",
        "the class itself: DistributedFusedAdam is ZeRO with (Fused)Adam/AdamW, and so on",
    ),
    "parameters_as_bucket_view": (
        "torch's ZeroRedundancyOptimizer",
        "nothing to set: params are always views of flat buffers",
    ),
    "overlap_with_ddp": (
        "torch's ZeroRedundancyOptimizer",
        "no DDP wrapper: overlap_grad_sync and overlap_param_sync",
    ),
}


def unknown_keywords_error(owner: str, unknown: set[str]) -> TypeError:
    """The TypeError for keywords no distributed class takes, naming counterparts it knows."""
    lines = [f"{owner}.__init__() got unexpected keyword arguments {sorted(unknown)}"]
    for name in sorted(unknown & COUNTERPARTS.keys()):
        whose, counterpart = COUNTERPARTS[name]
        lines.append(f"  {name} ({whose}): {counterpart}")
    if len(lines) > 1:
        lines.append("  (docs/migration.md maps the rest)")
    return TypeError("\n".join(lines))
