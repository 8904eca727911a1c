"""A single-process reference that counts steps per param, as torch.optim does.

The single-process shardopt classes count steps per param group (Apex's convention, docs/spec.md):
a param that gets its first grad at group step 5 is bias-corrected with t = 5. torch.optim, and so
DDP + torch.optim, counts each param's own steps, and the DistributedFused* classes follow torch:
a param no rank computed a grad for keeps its value, state and step. For
LAMB and NovoGrad, which torch.optim lacks, ``OwnStepReference`` is the reference of that rule:
one single-process optimizer per param (its group step is then that param's own step), with
LAMB's global grad-norm clipping applied first over every grad, as one grouped LAMB would.
"""

from __future__ import annotations

import torch


class OwnStepReference:
    """``cls`` over ``groups`` (torch.optim param-group list), one optimizer per param."""

    def __init__(self, cls, groups, **kw) -> None:
        self.max_grad_norm = float(kw.get("max_grad_norm", 0.0) or 0.0)
        if "max_grad_norm" in kw:
            kw = dict(kw, max_grad_norm=0.0)  # applied over all params in step()
        self.params: list[torch.Tensor] = []
        self.opts = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.params.append(p)
                self.opts.append(cls([p], **{**kw, **options}))

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.max_grad_norm > 0 and grads:
            norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
            if norm > self.max_grad_norm:
                for g in grads:
                    g.mul_(self.max_grad_norm / norm)
        for opt in self.opts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)
