"""Apex's surface on the ZeRO engine: ``compat`` (Apex DistributedFusedAdam's keyword arguments,
defaults, warnings and methods, mapped onto the engine's settings) and ``user_buffers`` (NCCL
user-buffer registration, Apex's ``nccl_ub``). The engine calls them; they import only the
engine's lower layers."""
