"""The optimizers bench_muon.py times in its own process: each builds a step over one set's Muon
matrices and its AdamW params, with the library's default settings.

A contender that cannot be built (a package not installed, an option this shardopt lacks) raises
``Unavailable`` with the reason; bench_muon.py reports it and goes on. heavyball compiled and
DeepSpeed run in subprocesses instead (bench_muon_worker.py): their compiles and distributed
set-up get a hard time limit there.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

import torch

LR = 1e-3
ADAMW_LR = 1e-3
WEIGHT_DECAY = 0.1
ADAMW_WEIGHT_DECAY = 0.01


class Unavailable(Exception):
    """A contender that cannot run here; the message says why."""


Step = Callable[[], None]
#: a builder takes (shardopt, muon_params, adamw_params) and returns the step and its optimizers
Builder = Callable[[Any, list, list], tuple[Step, list]]


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(module: str, dist: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"{dist} not installed ({type(exc).__name__}: {exc})") from exc


def _torch_adamw(adamw_params: list) -> torch.optim.Optimizer:
    """The AdamW part of every peer: torch's fused AdamW (foreach where fused is not built)."""
    kwargs = {"lr": ADAMW_LR, "weight_decay": ADAMW_WEIGHT_DECAY}
    try:
        return torch.optim.AdamW(adamw_params, fused=True, **kwargs)
    except RuntimeError:
        return torch.optim.AdamW(adamw_params, foreach=True, **kwargs)


def _pair(muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> tuple[Step, list]:
    def step() -> None:
        muon.step()
        adamw.step()

    return step, [muon, adamw]


def gram_option() -> tuple[str, str] | None:
    """FusedMuon's Gram Newton-Schulz switch as ``(argument, value)``, or None: read from the
    constructor's signature and shardopt.algorithms.muon's ``NS_ALGORITHMS`` at run time (the
    option is newer than this benchmark)."""
    import shardopt
    from shardopt.algorithms import muon as muon_alg

    params = inspect.signature(shardopt.FusedMuon.__init__).parameters
    for arg in ("ns_algorithm", "ns_method"):
        if arg in params:
            names = getattr(muon_alg, "NS_ALGORITHMS", ("gram",))
            value = next((n for n in names if "gram" in str(n).lower()), None)
            return (arg, value) if value else None
    return None


def _fused(extra: dict[str, Any]) -> Builder:
    def build(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
        groups = [
            {"params": muon_params},
            {
                "params": adamw_params,
                "use_muon": False,
                "lr": ADAMW_LR,
                "weight_decay": ADAMW_WEIGHT_DECAY,
            },
        ]
        opt = shardopt.FusedMuon(groups, lr=LR, weight_decay=WEIGHT_DECAY, **extra)
        return opt.step, [opt]

    return build


def fused(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
    """shardopt.FusedMuon with its AdamW groups, default settings."""
    return _fused({})(shardopt, muon_params, adamw_params)


def fused_tuned(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
    """FusedMuon, default settings, with cuBLASLt's algorithms timed per matmul case
    (``kernels.set_matmul_tuning(32)`` around each step; the warm-up steps time them)."""
    kernels = shardopt.kernels
    if not hasattr(kernels, "set_matmul_tuning"):
        raise Unavailable("this shardopt has no kernels.set_matmul_tuning")
    step, opts = fused(shardopt, muon_params, adamw_params)

    def tuned_step() -> None:
        saved = kernels.matmul_tuning()
        kernels.set_matmul_tuning(32)
        try:
            step()
        finally:
            kernels.set_matmul_tuning(saved)

    return tuned_step, opts


def _fused_gram(ns_dtype: torch.dtype | None) -> Builder:
    """FusedMuon with Gram Newton-Schulz, where this shardopt has the option; in ``ns_dtype``
    (None: the class's default, bf16). fp16 is the precision in which Gram keeps the spec's
    accuracy (in bf16 its error is up to twice torch's; spec.md)."""

    def build(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
        option = gram_option()
        if option is None:
            raise Unavailable("this shardopt's FusedMuon has no Gram Newton-Schulz option")
        extra = {option[0]: option[1]}
        if ns_dtype is not None:
            extra["ns_dtype"] = ns_dtype
        return _fused(extra)(shardopt, muon_params, adamw_params)

    return build


def torch_muon(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
    """torch.optim.Muon (torch >= 2.9) + torch.optim.AdamW(fused=True): the baseline."""
    cls = getattr(torch.optim, "Muon", None)
    if cls is None:
        raise Unavailable(f"torch {torch.__version__} has no torch.optim.Muon (>= 2.9)")
    muon = cls(muon_params, lr=LR, weight_decay=WEIGHT_DECAY)
    return _pair(muon, _torch_adamw(adamw_params))


def _emerging(use_syrk: bool) -> Builder:
    def build(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
        module = _import("emerging_optimizers.orthogonalized_optimizers", "emerging-optimizers")
        kwargs = {"lr": LR, "weight_decay": WEIGHT_DECAY}
        if use_syrk:
            if not torch.cuda.is_available():
                raise Unavailable("use_syrk is a Triton kernel: CUDA only")
            kwargs["use_syrk"] = True
        return _pair(module.Muon(muon_params, **kwargs), _torch_adamw(adamw_params))

    return build


def heavyball_eager(shardopt: Any, muon_params: list, adamw_params: list) -> tuple[Step, list]:
    """heavyball.Muon with compilation off (``heavyball.utils.compile_mode = None``), its
    defaults otherwise; the compiled default runs in bench_muon_worker.py."""
    heavyball = _import("heavyball", "heavyball")
    heavyball.utils.compile_mode = None
    return _pair(_heavyball_muon(heavyball, muon_params), _torch_adamw(adamw_params))


def heavyball_compiled(
    shardopt: Any, muon_params: list, adamw_params: list, mode: str | None = None
) -> tuple[Step, list]:
    """heavyball.Muon compiled: in its own torch.compile mode ("max-autotune-no-cudagraphs",
    whose autotuning outlasted a 212 s limit on an H100) or in ``mode`` (``HEAVYBALL_MODES``)."""
    heavyball = _import("heavyball", "heavyball")
    if mode is not None:
        heavyball.utils.compile_mode = mode
    return _pair(_heavyball_muon(heavyball, muon_params), _torch_adamw(adamw_params))


def _heavyball_muon(heavyball: Any, muon_params: list) -> torch.optim.Optimizer:
    """heavyball.Muon keeping the grads: by default its step sets ``p.grad = None``
    (``consume_grad``), and every timed step after the first would find no grad and do nothing."""
    muon = heavyball.Muon(muon_params, lr=LR, weight_decay=WEIGHT_DECAY)
    muon.consume_grad = False
    return muon


def grads_lost(params: tuple[list, list]) -> str | None:
    """An error if a timed step dropped grads (later steps of such a contender did no work)."""
    lost = sum(p.grad is None for group in params for p in group)
    return (
        f"the step set {lost} grads to None: its later timed steps had nothing to do"
        if lost
        else None
    )


#: in-process contenders, in the order they run; "torch" is the baseline of every ratio
IN_PROCESS: dict[str, Builder] = {
    "torch": torch_muon,
    "fused": fused,
    "fused_tuned": fused_tuned,
    "fused_gram": _fused_gram(None),
    "fused_gram16": _fused_gram(torch.float16),
    "emerging": _emerging(use_syrk=False),
    "emerging_syrk": _emerging(use_syrk=True),
    "heavyball_eager": heavyball_eager,
}

#: contenders run by bench_muon_worker.py in a subprocess with a time limit
SUBPROCESS = ("heavyball", "heavyball_default", "deepspeed")
#: the torch.compile mode of each compiled heavyball contender (None: heavyball's own)
HEAVYBALL_MODES = {"heavyball": None, "heavyball_default": "default"}

#: the distribution behind each contender, for its version in the report
DISTRIBUTIONS = {
    "torch": "torch",
    "fused": "shardopt",
    "fused_tuned": "shardopt",
    "fused_gram": "shardopt",
    "fused_gram16": "shardopt",
    "emerging": "emerging-optimizers",
    "emerging_syrk": "emerging-optimizers",
    "heavyball_eager": "heavyball",
    "heavyball": "heavyball",
    "heavyball_default": "heavyball",
    "deepspeed": "deepspeed",
}

CONTENDERS = (*IN_PROCESS, *SUBPROCESS)
