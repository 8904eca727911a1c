"""Ranks that leave lockstep get a LockstepError naming each rank, never gloo's SIGABRT or a hang.

See Note: lockstep (shardopt/zero/lockstep.py). Each case runs on gloo worlds 1-3 under a
process-group timeout, so a hang or an abort fails it. Out-of-lockstep cases make the last rank
(rank 1 of 2, rank 2 of 3) deviate; every rank must raise, naming every rank. A skipped step is
caught also where the other ranks take the grad norm before their step (``clip_grad_norm()``,
``grad_norm()``, torch's ``clip_grad_norm_`` routed, a GradScaler with a clip, LAMB's built-in
clipping), and a clip on some ranks only; so is an extra step() on one rank (a rank with no
backward while the others ran one). The patterns that are in lockstep (accumulation without
no_sync, every rank dropping a batch, a rank without a batch that backpropagates a zero loss)
keep working and match a reference; a clipped run matches DDP + torch.optim and its norms are
bit-identical to one sum all-reduce of each rank's partial (the computation before the norm
carried the check); the check adds no collective to a step. With a redundant group (HSDP,
world 4) a zero_grad() before the step or the clip on one rank makes every rank raise, and the
clipped norm is unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_cases

import shardopt
from shardopt import kernels
from shardopt.zero import comm
from shardopt.zero.lockstep import LockstepError, flags_numel

PG_TIMEOUT = 30.0
BUCKET_MB = 16 * 4 / 2**20  # several buckets
TOL = dict(rtol=1.3e-6, atol=1e-5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _opt(model, **kw):
    return shardopt.DistributedFusedAdam(model.parameters(), lr=0.01, bucket_cap_mb=BUCKET_MB, **kw)


def _backward(model, step, rank, k=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    model(torch.randn(2, 3, generator=gen)).sum().backward()


def _expect_lockstep_error(rank, world, run, *fragments):
    """``run()`` raises LockstepError on every rank, naming every rank and ``fragments``."""
    if world == 1:
        run()  # nothing to differ from
        return
    with pytest.raises(LockstepError) as info:
        run()
    message = str(info.value)
    for r in range(world):
        assert f"rank {r} is " in message, message
    for fragment in fragments:
        assert fragment in message, message


def _deviate(kind, overlap):
    """Three iterations; in the second the last rank deviates as ``kind`` says."""

    def run_on(rank, world):
        model = _model()
        opt = _opt(model, overlap_grad_sync=overlap)
        deviant = rank == world - 1 and world > 1

        def loop():
            for step in range(3):
                _backward(model, step, rank)
                if deviant and step == 1:
                    if kind == "zero_grad":
                        opt.zero_grad()
                    elif kind == "skip_step":
                        continue
                opt.step()
                opt.zero_grad()

        fragment = {
            "zero_grad": "dropped by a zero_grad() before step()",
            "skip_step": "skipped a step()" if overlap else "after 2 synchronised backward passes",
        }[kind]
        _expect_lockstep_error(rank, world, loop, fragment, "step() #2")

    return run_on


def zero_grad_between_backward_and_step(rank, world):
    _deviate("zero_grad", overlap=True)(rank, world)


def zero_grad_between_backward_and_step_no_overlap(rank, world):
    _deviate("zero_grad", overlap=False)(rank, world)


def step_skipped_once(rank, world):
    _deviate("skip_step", overlap=True)(rank, world)


def step_skipped_once_no_overlap(rank, world):
    _deviate("skip_step", overlap=False)(rank, world)


def batch_skipped_after_caught_exception(rank, world):
    """The last rank's loss check raises after its backward; the loop catches it and goes on
    to the next batch (its step() is skipped)."""
    model = _model()
    opt = _opt(model)

    def loop():
        for step in range(3):
            try:
                _backward(model, step, rank)
                if step == 1 and rank == world - 1 and world > 1:
                    raise FloatingPointError("loss is not finite")
                opt.step()
            except FloatingPointError:
                continue
            opt.zero_grad()

    _expect_lockstep_error(rank, world, loop, "skipped a step()")


def _reference_step(ref, ref_opt, grads_of):
    """The reference: DistributedFusedAdam fed the same summed per-rank grads via no_sync."""
    for k, fn in enumerate(grads_of):
        if k < len(grads_of) - 1:
            with ref_opt.no_sync():
                fn(ref)
        else:
            fn(ref)
    ref_opt.step()
    ref_opt.zero_grad()


def accumulation_without_no_sync_is_lockstep(rank, world):
    """Two synchronised backward passes per step on every rank (DDP without no_sync): no error,
    the same result as accumulating with no_sync."""
    for overlap in (True, False):
        model, ref = _model(), _model()
        opt, ref_opt = _opt(model, overlap_grad_sync=overlap), _opt(ref)
        for step in range(3):
            for k in range(2):
                _backward(model, step, rank, k)
            opt.step()
            opt.zero_grad()
            passes = [lambda m, k=k, s=step: _backward(m, s, rank, k) for k in range(2)]
            _reference_step(ref, ref_opt, passes)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, **TOL)


def every_rank_drops_a_batch(rank, world):
    """Every rank runs backward, then zero_grad() and skips that batch: in lockstep; equal to a
    run that never saw the batch."""
    for overlap in (True, False):
        model, ref = _model(), _model()
        opt, ref_opt = _opt(model, overlap_grad_sync=overlap), _opt(ref)
        for step in range(3):
            _backward(model, step, rank)
            if step == 1:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            _backward(ref, step, rank)
            ref_opt.step()
            ref_opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, **TOL)
        opt.zero_grad()  # then every rank calls step() with no grads: nothing changes
        before = copy.deepcopy(model.state_dict())
        _backward(model, 9, rank)
        opt.zero_grad()
        opt.step()
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


def extra_step_on_one_rank(rank, world):
    """The last rank calls step() twice in the second iteration: every rank raises at that
    step() (#3 on every rank), instead of running one iteration apart until the last rank
    waits alone at the end."""
    for overlap in (True, False):
        model = _model()
        opt = _opt(model, overlap_grad_sync=overlap)

        def loop(model=model, opt=opt):
            for step in range(3):
                _backward(model, step, rank)
                opt.step()
                if step == 1 and rank == world - 1 and world > 1:
                    opt.step()
                opt.zero_grad()

        _expect_lockstep_error(
            rank, world, loop, "step() #3 after 0 synchronised backward passes", "extra step()"
        )


def a_rank_without_batch_backpropagates_a_zero_loss(rank, world):
    """The last rank has no batch in one iteration: without a backward it is out of lockstep
    (its step() is an extra step() to the others); with the backward of a zero loss, as under
    DDP, its grads count as zeros and the run matches the reference."""
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model), _opt(ref)
    for step in range(2):
        idle = step == 1 and rank == world - 1 and world > 1
        if idle:
            (model(torch.zeros(2, 3)).sum() * 0.0).backward()
        else:
            _backward(model, step, rank)
        opt.step()
        opt.zero_grad()
        if idle:  # the reference: a batch of its own whose loss counts nothing
            (ref(torch.randn(2, 3)).sum() * 0.0).backward()
        else:
            _backward(ref, step, rank)
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **TOL)

    model = _model()
    opt = _opt(model)

    def loop():
        for step in range(2):
            if not (step == 1 and rank == world - 1 and world > 1):
                _backward(model, step, rank)
            opt.step()
            opt.zero_grad()

    _expect_lockstep_error(rank, world, loop, "after 0 synchronised backward passes")


def _before_step(kind, model, opt, scaler):
    """What every rank in lockstep runs between its backward and its step()."""
    if kind == "clip":
        opt.clip_grad_norm(0.5)
    elif kind == "grad_norm":
        opt.grad_norm().item()  # e.g. logged
    elif kind == "torch_clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    elif kind == "scaler_clip":
        scaler.unscale_(opt)
        opt.clip_grad_norm(0.5, grad_scaler=scaler)


def _deviate_normed(kind, overlap, lamb=False):
    """Three iterations, the norm taken before every step() (as ``kind`` says); in the second
    the last rank skips its norm and step() (``kind="clip_skipped"``: only its clip)."""

    def run_on(rank, world):
        model = _model()
        if lamb:  # the norm inside step() (built-in clipping), after its flags all-reduce
            opt = shardopt.DistributedFusedLAMB(
                model.parameters(), lr=0.01, max_grad_norm=0.5, bucket_cap_mb=BUCKET_MB,
                overlap_grad_sync=overlap,
            )  # fmt: skip
        else:
            opt = _opt(model, overlap_grad_sync=overlap)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if kind == "scaler_clip" else None
        deviant = rank == world - 1 and world > 1

        def loop():
            for step in range(3):
                gen = torch.Generator().manual_seed(1000 * step + 10 * rank)
                loss = model(torch.randn(2, 3, generator=gen)).sum()
                (loss if scaler is None else scaler.scale(loss)).backward()
                if deviant and step == 1:
                    if kind != "clip_skipped":
                        continue
                    opt.step()
                    opt.zero_grad()
                    continue
                _before_step("clip" if kind == "clip_skipped" else kind, model, opt, scaler)
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()

        if kind == "clip_skipped":
            fragments = ["is in step() #2", "is computing the grad norm"]
        elif lamb:
            fragments = ["skipped a step()" if overlap else "after 2 synchronised backward"]
        else:
            fragments = [
                "is computing the grad norm",
                "skipped a step()" if overlap else "after 2 synchronised backward passes",
            ]
        _expect_lockstep_error(rank, world, loop, "step() #2", *fragments)

    return run_on


def step_skipped_while_others_clip(rank, world):
    for overlap in (True, False):
        _deviate_normed("clip", overlap)(rank, world)


def step_skipped_while_others_take_grad_norm(rank, world):
    for overlap in (True, False):
        _deviate_normed("grad_norm", overlap)(rank, world)


def step_skipped_while_others_clip_through_torch(rank, world):
    for overlap in (True, False):
        _deviate_normed("torch_clip", overlap)(rank, world)


def step_skipped_while_others_clip_under_grad_scaler(rank, world):
    for overlap in (True, False):
        _deviate_normed("scaler_clip", overlap)(rank, world)


def step_skipped_with_lamb_clipping_in_step(rank, world):
    for overlap in (True, False):
        _deviate_normed("none", overlap, lamb=True)(rank, world)


def clip_skipped_on_one_rank(rank, world):
    """The last rank steps without the clip the others run: its step's all-reduce meets their
    norm's, and both say what they were in."""
    for overlap in (True, False):
        _deviate_normed("clip_skipped", overlap)(rank, world)


def _old_norm(opt) -> torch.Tensor:
    """The norm as computed before it carried the check: one sum all-reduce of this rank's
    partial sum of squares (after the grads are synchronised)."""
    total = torch.zeros(1, dtype=torch.float32)
    for key in opt.sharded.keys:
        total += kernels.norm([key.buffers.grad_shard])[0].float()
    comm.all_reduce(total, None)
    return (total.sqrt() * opt.amp.grad_factor).reshape(())


def clipped_run_matches_ddp_and_old_norms(rank, world):
    """Clipped steps (clip_grad_norm, torch's clip_grad_norm_ routed, grad_norm): the norms are
    bit-identical to the computation before, and the params equal DDP + torch.optim.AdamW with
    torch's clip within tolerance."""
    model, twin = _model(), _model()
    opt = _opt(model)
    ddp = nn.parallel.DistributedDataParallel(twin) if world > 1 else twin
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.0)
    clipped = 0
    for step in range(4):
        for m in (model, ddp):
            gen = torch.Generator().manual_seed(1000 * step + 10 * rank)
            (m(torch.randn(2, 3, generator=gen)).sum() * 20.0).backward()
        opt.finish_grad_sync()
        expected = _old_norm(opt)
        if step % 2:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = opt.clip_grad_norm(1.0)
        assert torch.equal(norm, expected), (step, norm, expected)
        assert torch.equal(opt.grad_norm(), expected)
        ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        clipped += bool(ref_norm > 1.0)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    assert clipped >= 3, "clipping must be active"


def _counting_all_reduces(run):
    calls = []
    original = comm.all_reduce

    def counting(tensor, group, op="sum", async_op=False):
        calls.append((tuple(tensor.shape), op))
        return original(tensor, group, op, async_op)

    comm.all_reduce = counting
    try:
        run()
    finally:
        comm.all_reduce = original
    return calls


def check_adds_no_collective(rank, world):
    """A step in lockstep issues exactly the all-reduces it issued before the check existed,
    all of one shape and reduction: one (the unused-param flags) for Adam without clipping or a
    GradScaler; two (the norm's, the flags') with a clip, a GradScaler or both."""
    model = _model()
    opt = _opt(model)
    layout = ((flags_numel(len(opt.params), world),), "sum")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for kind, per_step in (("plain", 1), ("clip", 2), ("scaler", 2), ("scaler_clip", 2)):

        def run(kind=kind):
            for _ in range(3):
                loss = model(torch.randn(2, 3)).sum()
                (loss if "scaler" not in kind else scaler.scale(loss)).backward()
                if "clip" in kind:
                    opt.clip_grad_norm(0.5)
                if "scaler" in kind:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()

        calls = _counting_all_reduces(run)
        assert calls == [layout] * (3 * per_step), (kind, calls)


def _hsdp_opt(model, rank):
    """World 4: shard groups [0 1] [2 3], replica groups [0 2] [1 3]."""
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return _opt(model, process_group=shard[rank // 2], redundant_process_group=replica[rank % 2])


def _hsdp_deviate(clip):
    """Rank 3 calls zero_grad() between backward and step() (a skipped step is not covered with
    a redundant group: see Note: lockstep); every rank raises, rank 0 told by rank 2."""

    def run_on(rank, world):
        assert world == 4
        model = _model()
        opt = _hsdp_opt(model, rank)

        def loop():
            for step in range(3):
                _backward(model, step, rank)
                if rank == 3 and step == 1:
                    opt.zero_grad()
                if clip:
                    opt.clip_grad_norm(0.5)
                opt.step()
                opt.zero_grad()

        with pytest.raises(LockstepError) as info:
            loop()
        message = str(info.value)
        if rank == 0:  # told through its replica group by rank 2
            assert "another shard group left lockstep (rank 2 " in message, message
        else:  # rank 1 meets rank 3 in their replica group; ranks 2, 3 in their shard group
            mate = {1: 3, 2: 3, 3: 2}[rank]
            for r in (rank, mate):
                assert f"rank {r} is " in message, message
            assert "dropped by a zero_grad()" in message, message

    return run_on


def hsdp_zero_grad_before_step(rank, world):
    _hsdp_deviate(clip=False)(rank, world)


def hsdp_zero_grad_before_clip(rank, world):
    _hsdp_deviate(clip=True)(rank, world)


def hsdp_clipped_run_keeps_old_norms(rank, world):
    """HSDP in lockstep: clipping works and the norm is the shard group's sum of the partials,
    bit-identical to the computation before."""
    model = _model()
    opt = _hsdp_opt(model, rank)
    for step in range(3):
        _backward(model, step, rank)
        opt.finish_grad_sync()
        total = torch.zeros(1, dtype=torch.float32)
        for key in opt.sharded.keys:
            total += kernels.norm([key.buffers.grad_shard])[0].float()
        comm.all_reduce(total, opt.process_group)
        expected = (total.sqrt() * opt.amp.grad_factor).reshape(())
        assert torch.equal(opt.clip_grad_norm(0.5), expected)
        opt.step()
        opt.zero_grad()


HSDP_CASES = [
    hsdp_zero_grad_before_step,
    hsdp_zero_grad_before_clip,
    hsdp_clipped_run_keeps_old_norms,
]


@pytest.mark.parametrize("case", HSDP_CASES, ids=lambda c: c.__name__)
def test_lockstep_hsdp_world4(hsdp_results, case):
    err = hsdp_results[case.__name__]
    assert err is None, err


@pytest.fixture(scope="module")
def hsdp_results():
    return run_cases(HSDP_CASES, 4, timeout=400.0, pg_timeout=PG_TIMEOUT, report_hangs=True)


CASES = [
    zero_grad_between_backward_and_step,
    zero_grad_between_backward_and_step_no_overlap,
    step_skipped_once,
    step_skipped_once_no_overlap,
    batch_skipped_after_caught_exception,
    accumulation_without_no_sync_is_lockstep,
    every_rank_drops_a_batch,
    extra_step_on_one_rank,
    a_rank_without_batch_backpropagates_a_zero_loss,
    step_skipped_while_others_clip,
    step_skipped_while_others_take_grad_norm,
    step_skipped_while_others_clip_through_torch,
    step_skipped_while_others_clip_under_grad_scaler,
    step_skipped_with_lamb_clipping_in_step,
    clip_skipped_on_one_rank,
    clipped_run_matches_ddp_and_old_norms,
    check_adds_no_collective,
]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(CASES, request.param, timeout=400.0, pg_timeout=PG_TIMEOUT, report_hangs=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_lockstep(results, case):
    err = results[case.__name__]
    assert err is None, err
