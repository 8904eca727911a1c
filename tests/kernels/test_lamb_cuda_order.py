"""``lamb_stage1(cuda_order=True)`` on CPU tensors: LAMB's per-tensor sums of squares in the CUDA
kernel's order (csrc/norm/cuda_order_cpu.h), so that the CPU update of an offloaded shard on a
CUDA job gives the CUDA kernel's bits (docs/spec.md, CPU offload on GPUs).

On CPU: the kernel against an independent emulation of that order in torch fp32 ops (the thread
accumulators of one block per 65,536-element chunk, the peeled head, groups of 4 (fp32) or 2
(fp64), the tail, the warp-shuffle trees, the per-tensor pass over the chunk partials), the moments
against the default order's, and the sums against fp64. On a GPU (``cuda``): the CPU kernel
against the CUDA kernel, bit for bit, on views at every alignment and with more chunk partials
than a block has threads."""

import pytest
import torch

from shardopt import kernels

BLOCK, CHUNK = 512, 65536
ARGS = dict(
    beta1=0.9, beta2=0.999, eps=1e-6, step=3, bias_correction=True, weight_decay=0.01,
    grad_averaging=True, adam_w_mode=True,
)  # fmt: skip


def _tree(v: torch.Tensor) -> torch.Tensor:
    """Shuffle-down trees over rows of 32 lanes: lane l adds lane l + offset (its own value past
    the warp); lane 0's values."""
    for off in (16, 8, 4, 2, 1):
        v = v + torch.cat([v[:, off:], v[:, 32 - off :]], dim=1)
    return v[:, 0]


def _block(acc: torch.Tensor) -> torch.Tensor:
    warps = _tree(acc.view(BLOCK // 32, 32))
    return _tree(torch.cat([warps, torch.zeros(32 - BLOCK // 32, dtype=acc.dtype)])[None])[0]


def _chunk_sum(x: torch.Tensor, head: int, g: int) -> torch.Tensor:
    acc = torch.zeros(BLOCK, dtype=x.dtype)
    n = x.numel()

    def scalar(part: torch.Tensor) -> None:
        for base in range(0, part.numel(), BLOCK):
            row = part[base : base + BLOCK]
            acc[: row.numel()] += row

    if head < 0 or head >= n:
        scalar(x)
    else:
        groups = (n - head) // g
        scalar(x[:head])
        body = x[head : head + groups * g].view(groups, g)
        for base in range(0, groups, BLOCK):
            rows = body[base : base + BLOCK]
            for e in range(g):
                acc[: rows.shape[0]] += rows[:, e]
        scalar(x[head + groups * g :])
    return _block(acc)


def _head(tensors: list[torch.Tensor], g: int) -> int:
    for h in range(g):
        if all(
            (t.data_ptr() + h * t.element_size()) % (t.element_size() * g) == 0 for t in tensors
        ):
            return h
    return -1


def _emulated(grads, params, exp_avg, exp_avg_sq):
    """(w_sq, u_sq) in the CUDA order from the inputs; the moments are updated in place by the
    default kernel (the order of the sums does not change them)."""
    kernels.lamb_stage1([grads, params, exp_avg, exp_avg_sq], **ARGS)
    b1, b2, eps, wd, t = (ARGS[k] for k in ("beta1", "beta2", "eps", "weight_decay", "step"))
    w_out, u_out = [], []
    for g_t, p, m, v in zip(grads, params, exp_avg, exp_avg_sq):
        acc = p.dtype
        g = 16 // max(g_t.element_size(), p.element_size())
        # the update term, as the kernel's fp32 (fp64) operations in lamb_math.h's order
        bc1 = torch.tensor(1 - b1**t, dtype=torch.float64).to(acc)
        bc2 = torch.tensor(1 - b2**t, dtype=torch.float64).to(acc)
        # a correctly rounded square root (torch's fp32 CPU sqrt is not always): the fp64 root
        # of an fp32 value rounds correctly
        u = (m / bc1) / (torch.sqrt((v / bc2).double()).to(acc) + torch.tensor(eps, dtype=acc))
        u = u + torch.tensor(wd, dtype=acc) * p
        parts_w, parts_u = [], []
        for s in range(0, p.numel(), CHUNK):
            e = min(s + CHUNK, p.numel())
            head = _head([g_t[s:e], p[s:e], m[s:e], v[s:e]], g)
            parts_w.append(_chunk_sum(p[s:e] * p[s:e], head, g))
            parts_u.append(_chunk_sum(u[s:e] * u[s:e], head, g))
        w_out.append(_partials(parts_w, acc))
        u_out.append(_partials(parts_u, acc))
    return torch.stack(w_out).float(), torch.stack(u_out).float()


def _partials(parts: list, dtype) -> torch.Tensor:
    acc = torch.zeros(BLOCK, dtype=dtype)
    for base in range(0, len(parts), BLOCK):
        row = torch.stack(parts[base : base + BLOCK])
        acc[: row.numel()] += row
    return _block(acc)


def _views(sizes, offsets, grad_dtype, param_dtype, device, seed=0):
    """Tensors of ``sizes``, each a view at element ``offsets[k]`` (per slot) into a larger buffer,
    so the slots' alignments vary as the shard pieces' do."""
    gen = torch.Generator().manual_seed(seed)
    out = [[], [], [], []]
    for n in sizes:
        for k, (dtype, scale) in enumerate(
            [(grad_dtype, 1e-2), (param_dtype, 1.0), (param_dtype, 1e-3), (param_dtype, 1e-5)]
        ):
            base = torch.randn(n + 8, generator=gen, dtype=torch.float64) * scale
            if k == 3:
                base = base.abs()
            off = offsets[k]
            out[k].append(base.to(dtype).to(device)[off : off + n])
    return out


SIZES = [1, 17, 3 * CHUNK + 5, 1000, 0, 70_001]
OFFSETS = {"aligned": (0, 0, 0, 0), "head 1": (1, 1, 1, 1), "head 3": (3, 3, 3, 3),
           "misaligned": (1, 0, 2, 0)}  # fmt: skip


def _ulp_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp32)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


SIGNATURES = {"fp32": (torch.float32, torch.float32), "bf16 grads": (torch.bfloat16, torch.float32),
              "fp64": (torch.float64, torch.float64)}  # fmt: skip


@pytest.mark.parametrize("signature", list(SIGNATURES))
@pytest.mark.parametrize("offsets", list(OFFSETS.values()), ids=list(OFFSETS))
def test_cpu_cuda_order_matches_the_emulated_order(offsets, signature):
    grad_dtype, param_dtype = SIGNATURES[signature]
    cpu = torch.device("cpu")
    emulated = _views(SIZES, offsets, grad_dtype, param_dtype, cpu)
    want_w, want_u = _emulated(*emulated)
    lists = _views(SIZES, offsets, grad_dtype, param_dtype, cpu)
    w_sq, u_sq = kernels.lamb_stage1(lists, cuda_order=True, **ARGS)
    assert w_sq.dtype == u_sq.dtype == torch.float32  # as the CUDA kernel returns them
    assert _ulp_equal(w_sq, want_w), w_sq - want_w
    assert _ulp_equal(u_sq, want_u), u_sq - want_u
    for a, b in zip(lists[2] + lists[3], emulated[2] + emulated[3]):  # the same moments
        assert torch.equal(a, b)
    # the sums are the same values as the default order's up to rounding, and fp64's
    d_w, d_u = kernels.lamb_stage1(_views(SIZES, offsets, grad_dtype, param_dtype, cpu), **ARGS)
    torch.testing.assert_close(w_sq.double(), d_w.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(u_sq.double(), d_u.double(), rtol=1e-5, atol=0)
    assert w_sq[4].item() == u_sq[4].item() == 0.0  # the empty tensor
    assert (w_sq[[0, 1, 2, 3, 5]] > 0).all()


def test_cpu_cuda_order_does_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            lists = _views([5 * CHUNK + 3, 999], (1, 1, 1, 1), torch.bfloat16, torch.float32, "cpu")
            got.append(kernels.lamb_stage1(lists, cuda_order=True, **ARGS))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("offsets", list(OFFSETS.values()), ids=list(OFFSETS))
def test_cpu_cuda_order_gives_the_cuda_kernels_bits(offsets, grad_dtype):
    # 600 chunks: more partials per tensor than the per-tensor pass has threads
    sizes = [*SIZES, 600 * CHUNK + 3]
    dev = _views(sizes, offsets, grad_dtype, torch.float32, torch.device("cuda"))
    host = _views(sizes, offsets, grad_dtype, torch.float32, torch.device("cpu"))
    for a, b in zip(sum(dev, []), sum(host, [])):
        assert torch.equal(a.cpu(), b)
        assert a.data_ptr() % 16 == b.data_ptr() % 16  # the same alignments (the test's premise)
    cw, cu = kernels.lamb_stage1(dev, **ARGS)
    hw, hu = kernels.lamb_stage1(host, cuda_order=True, **ARGS)
    assert _ulp_equal(cw.cpu(), hw) and _ulp_equal(cu.cpu(), hu), (cw.cpu() - hw, cu.cpu() - hu)
    for a, b in zip(dev[2] + dev[3], host[2] + host[3]):
        assert torch.equal(a.cpu(), b)
