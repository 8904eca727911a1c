"""Where CPU offload on a GPU differs from the CUDA kernels by an ulp (docs/spec.md, CPU offload on
GPUs): the same Adam inputs through the CPU kernel and the CUDA kernel, then the optimizers'
first steps with and without offload, each mismatching element's inputs printed in hex.

    python3 launch_scripts/probe/probe_offload_bits.py [--out probe_bits.json]      # one GPU, ~20 s

1. Kernel: ``shardopt.kernels.adam`` on 4M random fp32 params (bf16 grads, bf16 out slot) on the
   CPU (host step) and on CUDA with a host step and with a device ``step_t`` (as the distributed
   classes call it), steps 1-3: mismatch counts per output and the first elements.
2. Optimizer: every ``DistributedFused*`` class at world 1 (NCCL), the model, hyperparameters
   and four steps of tests/offload/test_offload_cuda.py (``--steps``), fp32 and bf16 params, with
   and without ``offload="cpu"``: grads (a copy of the model's, whose p.grad the optimizer's
   hooks take) compared first (the same GPU computes both), then params and moments; for Adam
   with fp32 params each mismatching element's inputs, both results and fp32 recomputations of the
   formula of csrc/optim/adam_math.h with the bias corrections as the host and as fp32 give them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import struct
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from shardopt import kernels as K

LR, B1, B2, EPS, WD = 0.02, 0.9, 0.999, 1e-8, 0.05


def hexf(x: float) -> str:
    return struct.pack(">f", float(x)).hex()


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def recompute(p, g, m, v, t, bc_fp32: bool) -> dict[str, str]:
    """adam_math.h's update in fp32 arithmetic (numpy-free: each op rounded to fp32)."""
    bc1, bc2 = 1.0 - B1**t, 1.0 - B2**t
    if bc_fp32:
        bc1, bc2 = f32(1.0) - f32(f32(B1) ** t), f32(1.0) - f32(f32(B2) ** t)
    bc1, bc2 = f32(bc1), f32(bc2)
    b1, b2, lr, eps, wd = f32(B1), f32(B2), f32(LR), f32(EPS), f32(WD)
    m = f32(f32(b1 * m) + f32(f32(1 - b1) * g))
    v = f32(f32(b2 * v) + f32(f32(f32(1 - b2) * g) * g))
    d = f32(f32(m / bc1) / f32(f32(f32(v / bc2) ** 0.5) + eps))
    u = f32(d + f32(wd * p))
    p = f32(p - f32(lr * u))
    return {"p": hexf(p), "m": hexf(m), "v": hexf(v), "bc1": hexf(bc1), "bc2": hexf(bc2)}


def kernel_stage(n: int = 1 << 22) -> dict:
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen) * 0.5
    m0 = torch.randn(n, generator=gen) * 1e-3
    v0 = torch.rand(n, generator=gen) * 1e-6
    report = {}
    for t in (1, 2, 3):
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
        runs = {}
        for name, dev, device_step in (("cpu", "cpu", False), ("cuda", "cuda", False),
                                       ("cuda_step_t", "cuda", True)):  # fmt: skip
            p, m, v = (x.clone().to(dev) for x in (p0, m0, v0))
            out = torch.empty(n, dtype=torch.bfloat16, device=dev)
            step = dict(step=0, step_t=torch.tensor([float(t)], device=dev)) if device_step \
                else dict(step=t)  # fmt: skip
            K.adam([[g.to(dev)], [p], [m], [v], [out]], lr=LR, beta1=B1, beta2=B2, eps=EPS,
                   adam_w_mode=True, bias_correction=True, weight_decay=WD, **step)  # fmt: skip
            runs[name] = {k: x.cpu() for k, x in dict(p=p, m=m, v=v, out=out).items()}
        for name in ("cuda", "cuda_step_t"):
            entry = {}
            for k in ("p", "m", "v", "out"):
                a, b = runs["cpu"][k], runs[name][k]
                bits = torch.int32 if a.dtype == torch.float32 else torch.int16
                bad = a.view(bits) != b.view(bits)
                entry[k] = int(bad.sum())
            idx = (runs["cpu"]["p"] != runs[name]["p"]).nonzero().flatten()[:5].tolist()
            entry["first"] = [
                {
                    "in": {
                        "p": hexf(p0[i]),
                        "g": hexf(g[i].float()),
                        "m": hexf(m0[i]),
                        "v": hexf(v0[i]),
                    },  # fmt: skip
                    "cpu_p": hexf(runs["cpu"]["p"][i]),
                    name + "_p": hexf(runs[name]["p"][i]),
                    "fp32_formula_host_bc": recompute(p0[i], g[i].float(), m0[i], v0[i], t, False),
                    "fp32_formula_fp32_bc": recompute(p0[i], g[i].float(), m0[i], v0[i], t, True),
                }
                for i in idx
            ]
            report[f"step{t}_{name}"] = entry
        p0, m0, v0 = runs["cpu"]["p"], runs["cpu"]["m"], runs["cpu"]["v"]
    return report


CLASSES = {
    "Adam": (shardopt.DistributedFusedAdam, dict(lr=LR, weight_decay=WD)),
    "LAMB": (shardopt.DistributedFusedLAMB, dict(lr=0.02, max_grad_norm=1.0)),
    "NovoGrad": (shardopt.DistributedFusedNovoGrad, dict(lr=0.02, weight_decay=0.01)),
    "SGD": (shardopt.DistributedFusedSGD, dict(lr=0.05, momentum=0.9)),
    "Adagrad": (shardopt.DistributedFusedAdagrad, dict(lr=0.05)),
}


def run(name: str, offload, steps: int, device: str = "cuda", dtype=torch.float32):
    cls, hyper = CLASSES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 70)).to(device, dtype)
    shadow = copy.deepcopy(model)  # its grads: the optimizer's hooks take the model's p.grad
    opt = cls(model.parameters(), **hyper, bucket_cap_mb=8000 * 4 / 2**20, offload=offload)
    gen = torch.Generator(device=device).manual_seed(1)
    record = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen, device=device).to(dtype)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad(set_to_none=True)
        shadow(x).float().pow(2).mean().backward()
        model(x).float().pow(2).mean().backward()
        before = opt.state_dict()
        rec = {
            "p": [p.detach().cpu().clone() for p in model.parameters()],
            "g": [p.grad.detach().cpu().clone() for p in shadow.parameters()],
            "state": {
                pid: {k: t.clone() for k, t in e.items() if torch.is_tensor(t)}
                for pid, e in before["state"].items()
            },
        }
        opt.step()
        opt.zero_grad()
        opt.wait_param_sync()
        after = opt.state_dict()["state"]
        rec["after_p"] = [p.detach().cpu().clone() for p in model.parameters()]
        rec["after_state"] = {
            pid: {k: t.clone() for k, t in e.items() if torch.is_tensor(t)}
            for pid, e in after.items()
        }
        record.append(rec)
    opt.close()
    return record


def optimizer_stage(device: str = "cuda", dtype=torch.float32, steps: int = 4) -> dict:
    report = {}
    for name in CLASSES:
        r0, r1 = run(name, None, steps, device, dtype), run(name, "cpu", steps, device, dtype)
        for s, (a, b) in enumerate(zip(r0, r1), 1):
            entry = {
                "grads_equal": all(torch.equal(x, y) for x, y in zip(a["g"], b["g"])),
                "params_before_equal": all(torch.equal(x, y) for x, y in zip(a["p"], b["p"])),
                "param_mismatches": [
                    int((x != y).sum()) for x, y in zip(a["after_p"], b["after_p"])
                ],
                "state_mismatches": {
                    f"{pid}.{k}": int((t != b["after_state"][pid][k]).sum())
                    for pid, e in a["after_state"].items()
                    for k, t in e.items()
                    if t.dim() > 0
                },
            }
            if name == "Adam" and dtype == torch.float32:
                first = []
                for pi, (x, y) in enumerate(zip(a["after_p"], b["after_p"])):
                    for i in (x != y).flatten().nonzero().flatten()[:3].tolist():
                        st = a["state"].get(pi, {})
                        m = float(st["exp_avg"].flatten()[i]) if "exp_avg" in st else 0.0
                        v = float(st["exp_avg_sq"].flatten()[i]) if "exp_avg_sq" in st else 0.0
                        p, g = float(a["p"][pi].flatten()[i]), float(a["g"][pi].flatten()[i])
                        first.append({
                            "param": pi, "index": i,
                            "in": {"p": hexf(p), "g": hexf(g), "m": hexf(m), "v": hexf(v)},
                            "gpu_p": hexf(x.flatten()[i]), "offload_p": hexf(y.flatten()[i]),
                            "gpu_m": hexf(a["after_state"][pi]["exp_avg"].flatten()[i]),
                            "offload_m": hexf(b["after_state"][pi]["exp_avg"].flatten()[i]),
                            "fp32_formula_host_bc": recompute(p, g, m, v, s, False),
                            "fp32_formula_fp32_bc": recompute(p, g, m, v, s, True),
                        })  # fmt: skip
                entry["first"] = first[:6]
            report[f"{name}_step{s}"] = entry
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: the optimizer stage alone, on gloo")
    ap.add_argument("--dtypes", default="fp32,bf16", help="the optimizer stage's param dtypes")
    ap.add_argument("--steps", type=int, default=4, help="the optimizer stage's steps")
    args = ap.parse_args()
    report = {}
    if args.device == "cuda":
        torch.cuda.set_device(0)
        report["kernel"] = kernel_stage()
        print(json.dumps(report, indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo", store=store, rank=0, world_size=1
        )
        try:
            for name in args.dtypes.split(","):
                dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
                report[f"optimizer_{name}"] = optimizer_stage(args.device, dtype, args.steps)
        finally:
            dist.destroy_process_group()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
