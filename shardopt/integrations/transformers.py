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
"""

from __future__ import annotations

import transformers

from shardopt.integrations.accelerate import patch


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that runs ``DistributedFused*`` optimizers without DDP."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        patch(self.accelerator)


def patch_trainer(trainer: transformers.Trainer) -> transformers.Trainer:
    """Patches an existing Trainer's accelerator (before ``train()``); returns the trainer."""
    patch(trainer.accelerator)
    return trainer
