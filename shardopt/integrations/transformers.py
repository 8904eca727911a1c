"""Hugging Face ``transformers.Trainer`` with DistributedFused* optimizers.

    from shardopt.integrations.transformers import Trainer   # instead of transformers.Trainer
    opt = shardopt.DistributedFusedAdam(model.parameters(), lr=..., weight_decay=...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

``Trainer`` is ``transformers.Trainer`` whose accelerator is ``shardopt.integrations.accelerate.
patch``-ed: the model is not wrapped in DDP, gradient accumulation
(``gradient_accumulation_steps``) uses ``optimizer.no_sync()``, and ``max_grad_norm`` clipping
and the logged ``grad_norm`` use ``optimizer.clip_grad_norm`` (the norm of the full averaged
gradient). Build the optimizer on the model already on its device and dtype (the Trainer moves a
CPU model to the GPU; a param re-bound to another device raises at the first step).

Checkpoints (``save_strategy``, ``resume_from_checkpoint``): Trainer writes ``optimizer.pt``
from rank 0 only (``args.should_save``), so it calls ``optimizer.state_dict()`` there alone; for
a DistributedFused* optimizer that is a collective, which would wait for the other ranks and
fail (``CollectiveCallError``). ``Trainer._save_optimizer_and_scheduler`` therefore takes the
state dict on every rank first, then runs Trainer's own method with the optimizer's
``state_dict`` answering that dict: the files, their names and what rank 0 writes stay
Trainer's, for any version. Resuming needs nothing: Trainer loads ``optimizer.pt`` on every rank
and ``load_state_dict`` keeps each rank's shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import transformers

from shardopt.integrations.accelerate import patch
from shardopt.zero.engine import DistributedOptimizer

log = logging.getLogger("shardopt.integrations")

_SAVE = "_save_optimizer_and_scheduler"  # Trainer's method writing optimizer.pt and the scheduler


def _is_sharded(optimizer: Any) -> bool:
    """Whether Trainer's optimizer is a DistributedFused* optimizer, or Accelerate's wrapper of
    one (which keeps it as ``.optimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return isinstance(optimizer, DistributedOptimizer) or isinstance(inner, DistributedOptimizer)


def save_optimizer_on_every_rank(
    trainer: transformers.Trainer, save: Callable[[str], None], output_dir: str
) -> None:
    """Runs Trainer's optimizer-and-scheduler save ``save(output_dir)`` with the optimizer's
    state dict taken on every rank first (a collective), so that the rank that writes it does
    not call it alone. Other optimizers go to ``save`` unchanged."""
    optimizer = trainer.optimizer
    if not _is_sharded(optimizer):
        save(output_dir)
        return
    state = optimizer.state_dict()  # every rank: the full state on each rank's CPU
    shadowed = vars(optimizer).get("state_dict")
    optimizer.state_dict = lambda: state  # what Trainer's save on the writing rank calls
    try:
        save(output_dir)
    finally:
        if shadowed is None:
            del optimizer.state_dict
        else:
            optimizer.state_dict = shadowed


def _check_trainer_version() -> None:
    if not callable(getattr(transformers.Trainer, _SAVE, None)):
        log.warning(
            "shardopt: transformers %s has no Trainer.%s; checkpoints with a DistributedFused* "
            "optimizer cannot be routed (saving fails with CollectiveCallError at world > 1): "
            "use save_only_model=True or shardopt.checkpoint",
            transformers.__version__,
            _SAVE,
        )


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that runs ``DistributedFused*`` optimizers without DDP and saves
    and resumes their state at any world size."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _check_trainer_version()
        patch(self.accelerator)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_optimizer_on_every_rank(self, super()._save_optimizer_and_scheduler, output_dir)


def patch_trainer(trainer: transformers.Trainer) -> transformers.Trainer:
    """Patches an existing Trainer (before ``train()``): its accelerator as ``Trainer``'s, and its
    optimizer save as ``Trainer``'s. Returns the trainer."""
    patch(trainer.accelerator)
    if not isinstance(trainer, Trainer) and not getattr(trainer, "_shardopt_save_routed", False):
        _check_trainer_version()
        save = getattr(trainer, _SAVE, None)
        if save is not None:
            setattr(
                trainer,
                _SAVE,
                lambda output_dir: save_optimizer_on_every_rank(trainer, save, output_dir),
            )
        trainer._shardopt_save_routed = True
    return trainer
