"""The step-time model's calibration on the measured rows and its checks against
docs/benchmarks.md (scaling_model.py)."""

from __future__ import annotations

import dataclasses

from scaling_inputs import (
    ADAM_BYTES,
    COLLECTIVES,
    KERNEL_13B,
    MODELS,
    SRC,
    STEP_ROWS,
    TORCH_FUSED_13B_MS,
    Layout,
    Machine,
)
from scaling_step import (
    bucket_sizes,
    fit_collectives,
    optimizer_ms,
    predict,
    predict_ddp,
    ring_ms,
)

# -- calibration and checks -----------------------------------------------------------------------


@dataclasses.dataclass
class Calibration:
    machine: Machine
    compute_ms: float  # the 1.4B's forward + backward at 8 x 1024 tokens per GPU
    given: bool = False  # compute_ms from --compute-ms, not derived


def calibrate(base: Machine, compute_override: float | None = None) -> Calibration:
    """alpha, NVLink bandwidth, then compute from the no-overlap row, then kappa from the
    overlap row (both 100 MB buckets, run 1): each row reproduced exactly by construction."""
    m = fit_collectives(base)
    shape = MODELS["1.4b"]
    nofit = next(r for r in STEP_ROWS if r.role == "fit: compute")
    if compute_override is None:
        lay = Layout(2, bucket_mb=nofit.bucket_mb, overlap=False)
        without = predict(shape, lay, m, compute=0.0).total
        compute = nofit.step_ms - without
    else:
        compute = compute_override
    krow = next(r for r in STEP_ROWS if r.role == "fit: kappa")
    lay = Layout(2, bucket_mb=krow.bucket_mb)
    m0 = dataclasses.replace(m, kappa=0.0)
    m1 = dataclasses.replace(m, kappa=1.0)
    t0, t1 = predict(shape, lay, m0, compute).total, predict(shape, lay, m1, compute).total
    kappa = (krow.step_ms - t0) / (t1 - t0)
    return Calibration(dataclasses.replace(m, kappa=kappa), compute, compute_override is not None)


def pct(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%"


def check_rows(cal: Calibration) -> list[list[str]]:
    """Every measured row against the model: [what, source, measured, predicted, error, role]."""
    m, shape, rows = cal.machine, MODELS["1.4b"], []
    for r in STEP_ROWS:
        if r.mode == "ddp_adamw":
            step = predict_ddp(shape, 2, m, cal.compute_ms, r.bucket_mb)
        else:
            lay = Layout(2, bucket_mb=r.bucket_mb, overlap=r.mode != "shardopt_adam")
            step = predict(shape, lay, m, cal.compute_ms)
        src = f"{SRC}, 2 x H200, {r.source}"
        what = f"{r.mode}, {r.bucket_mb:g} MB: step ms"
        err = pct(step.total, r.step_ms)
        rows.append([what, src, f"{r.step_ms:.1f}", f"{step.total:.1f}", err, r.role])
        if r.opt_ms is not None and r.mode != "ddp_adamw":
            what = f"{r.mode}, {r.bucket_mb:g} MB: optimizer step ms"
            err = pct(step.optimizer, r.opt_ms)
            rows.append([what, src, f"{r.opt_ms:.2f}", f"{step.optimizer:.2f}", err, "check"])
    rows.append(_ddp_opt_row(m))
    rows.append(_kernel_row(m))
    for label, mb, pieces, rs, ag in COLLECTIVES:
        sizes = bucket_sizes(mb, 1e9) if pieces == 1 else [mb / pieces] * pieces
        pred = sum(ring_ms(s, 2, 1, m.intra_busbw_gbps, m) for s in sizes)
        role = "fit: alpha, bandwidth" if pieces == 1 and "buckets" not in label else "check"
        for op, meas in (("reduce-scatter", rs), ("all-gather", ag)):
            rows.append([f"{label}: {op} ms", f"{SRC}, 2 x H200 collectives", f"{meas:.3f}",
                         f"{pred:.3f}", pct(pred, meas), role])  # fmt: skip
    return rows


def _kernel_row(m: Machine) -> list[str]:
    ms, gbps = KERNEL_13B
    params = ms * 1e-3 * gbps * 1e9 / ADAM_BYTES  # the 1.3b set's size, from its row
    pred = optimizer_ms(params, m)
    return ["1 GPU: FusedAdam step, 1.3b set, fp32", f"{SRC}, kernel table, one H200",
            f"{ms:.3f}", f"{pred:.3f}", pct(pred, ms), "check"]  # fmt: skip


def _ddp_opt_row(m: Machine) -> list[str]:
    pred = optimizer_ms(MODELS["1.4b"].params, m) * TORCH_FUSED_13B_MS / KERNEL_13B[0]
    meas = STEP_ROWS[-3].opt_ms
    what = "ddp_adamw: optimizer step ms (torch fused AdamW, all params)"
    return [what, f"{SRC}, 2 x H200, run 1", f"{meas:.2f}", f"{pred:.2f}", pct(pred, meas), "check"]
