"""The compact Adam lists of tests/kernels/test_adam_compact.py and
tests/kernels/test_state_codec_kernels.py: several tensors in one master mode and one state format,
built and read through state_codec."""

import torch

from shardopt import state_codec as sc

HYPER = dict(
    lr=1e-2,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    adam_w_mode=True,
    bias_correction=True,
    weight_decay=0.01,
)


class Compact:
    """The compact lists of several tensors: one master mode and one state format."""

    def __init__(self, sizes, master, fmt, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.master_mode, self.fmt, self.device = master, fmt, device
        masters = []
        for n in sizes:  # |p| >= 1 (docs/spec.md, test tolerances)
            x = torch.randn(n, generator=gen)
            masters.append(x.sign() * (1 + x.abs()))
        self.remainders = []
        if master == "fp32":
            self.params = masters
        elif master == "bf16+rem":
            self.params, self.remainders = map(list, zip(*(sc.split_master(x) for x in masters)))
        else:
            dtype = torch.bfloat16 if master == "bf16" else torch.float16
            self.params = [x.to(dtype) for x in masters]
        self.exp_avg, self.exp_avg_scales, self.exp_avg_sq, self.exp_avg_sq_scales = [], [], [], []
        for n in sizes:
            m = torch.randn(n, generator=gen) * 0.1
            v = torch.rand(n, generator=gen) * 0.01
            for x, signed, codes, scales in (
                (m, True, self.exp_avg, self.exp_avg_scales),
                (v, False, self.exp_avg_sq, self.exp_avg_sq_scales),
            ):
                c, s = sc.encode(x, fmt, signed=signed)
                codes.append(c)
                if s is not None:
                    scales.append(s)
        for name in (
            "params",
            "remainders",
            "exp_avg",
            "exp_avg_sq",
            "exp_avg_scales",
            "exp_avg_sq_scales",
        ):
            setattr(self, name, [t.to(device) for t in getattr(self, name)])

    def lists(self, grads):
        return [
            grads,
            self.params,
            self.remainders,
            self.exp_avg,
            self.exp_avg_sq,
            self.exp_avg_scales,
            self.exp_avg_sq_scales,
        ]

    def masters(self):
        if self.remainders:
            return [sc.join_master(p, r) for p, r in zip(self.params, self.remainders)]
        return [p.float() for p in self.params]

    def moments(self):
        scales_m = self.exp_avg_scales or [None] * len(self.exp_avg)
        scales_v = self.exp_avg_sq_scales or [None] * len(self.exp_avg_sq)
        m = [sc.decode(c, s, self.fmt, signed=True) for c, s in zip(self.exp_avg, scales_m)]
        v = [sc.decode(c, s, self.fmt, signed=False) for c, s in zip(self.exp_avg_sq, scales_v)]
        return m, v

    def steps(self):
        """Per element, one code step of the stored moments (the error allowed vs the reference)."""
        out = []
        for codes, scales, signed in (
            (self.exp_avg, self.exp_avg_scales, True),
            (self.exp_avg_sq, self.exp_avg_sq_scales, False),
        ):
            out.append(
                [
                    code_step(c, s, self.fmt, signed)
                    for c, s in zip(codes, scales or [None] * len(codes))
                ]
            )
        return out

    def zero(self):
        """Zero masters and moments (a fresh optimizer over zero-initialised params)."""
        for t in self.params + self.remainders:
            t.zero_()
        for codes, scales, signed in (
            (self.exp_avg, self.exp_avg_scales, True),
            (self.exp_avg_sq, self.exp_avg_sq_scales, False),
        ):
            for i, c in enumerate(codes):
                zc, zs = sc.encode(torch.zeros(c.numel()), self.fmt, signed=signed)
                c.copy_(zc)
                if zs is not None:
                    scales[i].copy_(zs)
        return self

    def snapshot(self):
        return [t.clone() for lst in self.lists([]) for t in lst]


def code_step(codes, scales, fmt, signed):
    """Per element, one code step of stored moments: the error allowed against a reference (of v
    from its root's code step ``s`` in the root formats: ``(r + s)^2 - r^2``)."""
    step = _stored_step(codes, scales, fmt, signed)
    if not sc.stores_root(fmt, signed):
        return step
    root = sc.decode(codes, scales, fmt, signed=False).sqrt()
    return step * (2 * root + step)


def _stored_step(codes, scales, fmt, signed):
    if fmt in ("bf16", "fp16", "scaled_fp16"):
        up = (codes.view(torch.int16) + 1).view(codes.dtype).float()
        step = (up - codes.float()).abs()
    elif fmt == "int8":
        values = sc.quantization_map(signed, codes.device)
        padded = torch.cat([values[:1], values, values[-1:]])
        gap = torch.maximum(padded[1:-1] - padded[:-2], padded[2:] - padded[1:-1])
        step = gap[codes.long()]
    else:
        return torch.zeros(codes.shape, device=codes.device)
    if scales is not None:
        step = step * scales.repeat_interleave(sc.BLOCK)[: codes.numel()]
    return step


def make_grads(sizes, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]
