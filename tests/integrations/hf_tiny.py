"""(helper) The tiny model, data and torchrun-like environment the HF/Accelerate tests share."""

from __future__ import annotations

import os

import torch
from torch import nn

#: the hyperparameters every HF/Accelerate test trains with (the references use them too)
LR, WD, MAX_NORM = 1e-2, 0.1, 1.0


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x, labels=None):
        out = self.b(torch.tanh(self.a(x)))
        if labels is None:
            return {"logits": out}
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    """16 samples; targets large enough that the grad norm exceeds 1 (clipping acts)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(16, 6, generator=g)
        self.y = 10 * torch.randn(16, 3, generator=g)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def set_env(rank: int, world: int, port: int, **extra: str) -> None:
    """The variables torchrun would set, Accelerate on CPU, and ``extra``."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCELERATE_USE_CPU="true",
        **extra,
    )


def training_args(out: str, **overrides):
    """The tests' ``transformers.TrainingArguments``: two samples per device, two accumulation
    steps, clipping at ``MAX_NORM``, a log line per step, CPU, no workers or tqdm, seed 0;
    ``overrides`` (the schedule, the length, the save strategy) on top."""
    import transformers

    kw = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=MAX_NORM,
        learning_rate=LR,
        weight_decay=WD,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    return transformers.TrainingArguments(**dict(kw, **overrides))
