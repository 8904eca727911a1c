"""A seeded random sweep of the DistributedFused* optimizers against DDP + torch.optim.

Each seed draws one configuration: world size 1-4 (from the seed, so every world size, 3 included,
appears in any run of four consecutive seeds), the class, fp32 or bf16 params, the bucket size
(a few elements to 100 MB), one or two param groups, overlap flags, and which of these the run
has: frozen, unused, tied and conditional params (used on some ranks, or on no rank at some
steps), gradient accumulation with no_sync or with several synchronised backwards, clip_grad_norm
(after scaler.unscale_ under a GradScaler), a GradScaler with an inf injected on one rank.

fp32 runs train a small model; the references are DDP(find_unused_parameters=True, on a process
group of its own) with the torch.optim class where there is one (AdamW, Adam, SGD, Adagrad), and
the single-process shardopt class fed DDP's averaged grads (the same kernels), one instance per
param so that each param counts its own steps as torch.optim does (own_step_reference.py; a
grouped single-process optimizer counts per group, which differs once a param had no grad on any
rank at some step).
After every step the params are compared at the fp32 tolerance (rtol=1.3e-6, atol=1e-5) and the
references restart from the distributed params (see test_ddp_contract._anchor). clip_grad_norm's
return value is compared with clip_grad_norm_'s; a step skipped for an inf must leave every param
unchanged, and the loss scale must follow GradScaler's rule.

bf16 runs (Adam and LAMB, the classes with single-process masters) use a synthetic loss whose
grads are multiples of 1/8, summed over ranks (average_grad_sync=False) so that they are exact in
bf16, against the single-process class with master_weights=True, at the bf16 tolerance
(rtol=5e-2, atol=1e-5); the fp32 masters at the fp32 tolerance when there is no clipping.

CI runs seeds 0-7 (two per world size); ``pytest -m slow`` runs seeds 8-407. The configurations:
sweep_configs.py; what each rank runs: sweep_runs.py; the zero-grad sweep of every state
format: test_sweep_zero_grads.py.
``SHARDOPT_SWEEP_SEEDS=a-b`` runs another range in the slow test, and ``SHARDOPT_SWEEP_EXCLUDE``
(comma-separated feature names, e.g. ``synced_accumulation,global_skip``) draws configurations
without those features: for triage only, the default draws everything.
"""

from __future__ import annotations

import pytest
from sweep_configs import (
    BUCKET_ELEMENTS,
    CLASSES,
    FAST_SEEDS,
    FEATURES,
    SLOW_SEEDS,
    features_excluded,
    make_config,
    run_seeds,
    seed_range,
)
from sweep_runs import run_bf16, run_fp32


def _case(seed: int):
    def case(rank, world):
        cfg = make_config(seed, features_excluded())
        assert cfg.world == world
        (run_bf16 if cfg.bf16 else run_fp32)(cfg, rank, world)

    case.__name__ = case.__qualname__ = f"seed_{seed}"
    return case


SEEDS = sorted(set(FAST_SEEDS) | set(SLOW_SEEDS) | set(seed_range(SLOW_SEEDS)))
for _seed in SEEDS:  # module-level functions: the spawned ranks find them by name
    globals()[f"seed_{_seed}"] = _case(_seed)


def _run(seeds: list[int]) -> dict[int, str | None]:
    return run_seeds({s: globals()[f"seed_{s}"] for s in seeds})


@pytest.fixture(scope="module")
def fast_results():
    return _run(FAST_SEEDS)


@pytest.fixture(scope="module")
def slow_results():
    return _run(seed_range(SLOW_SEEDS))


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_sweep(fast_results, seed):
    err = fast_results[seed]
    assert err is None, err


@pytest.mark.slow
@pytest.mark.parametrize("seed", seed_range(SLOW_SEEDS))
def test_sweep_long(slow_results, seed):
    err = slow_results[seed]
    assert err is None, err


def test_configs_cover_every_feature():
    """The long mode draws every feature, every class and every world size (the sweep is not
    quietly narrower than its docstring)."""
    cfgs = [make_config(s) for s in SLOW_SEEDS]
    for f in FEATURES:
        assert any(f in c.features for c in cfgs), f
    assert {c.name for c in cfgs} == set(CLASSES)
    assert {c.world for c in cfgs} == {1, 2, 3, 4}
    assert {c.bucket_elements for c in cfgs} == set(BUCKET_ELEMENTS)
    assert any(c.poison for c in cfgs) and any(c.bf16 and c.scaler for c in cfgs)
    fast = [make_config(s) for s in FAST_SEEDS]
    assert {c.world for c in fast} == {1, 2, 3, 4}
