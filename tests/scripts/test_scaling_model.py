"""launch_scripts/scaling/scaling_model.py: its checks against docs/benchmarks.md hold,
docs/scaling.md shows what the script computes, and the pieces behave as docs/scaling.md says."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launch_scripts" / "scaling"))

import scaling_model as sm  # noqa: E402


@pytest.fixture(scope="module")
def cal() -> sm.Calibration:
    return sm.calibrate(sm.Machine())


def test_step_rows_within_10_percent(cal):
    rows = [r for r in sm.check_rows(cal) if r[0].endswith("step ms")]
    assert len(rows) >= 10
    for what, _, measured, predicted, _, role in rows:
        err = abs(float(predicted) - float(measured)) / float(measured)
        if role.startswith("fit"):
            assert err < 1e-3, what  # the fitted rows are reproduced
        else:
            assert err < 0.10, f"{what}: measured {measured}, predicted {predicted}"


def test_docs_show_the_generated_numbers(cal):
    doc = (REPO / "docs" / "scaling.md").read_text()
    block = re.search(re.escape(sm.BEGIN) + r"\n\n(.*)\n" + re.escape(sm.END), doc, re.DOTALL)
    assert block, "docs/scaling.md lost its generated block"
    expected = sm.render(cal, sm.Machine(), 8, "")
    fix = "run: python launch_scripts/scaling/scaling_model.py --write-docs"
    assert block.group(1) == expected, fix


def test_ring_and_queues():
    m = sm.Machine(alpha_us=50.0, intra_busbw_gbps=250.0, lat_intra_us=2.0, lat_net_us=10.0)
    # 2 ranks, one node: alpha + half the bytes over the bus bandwidth (MB / GB/s = ms)
    assert sm.ring_ms(100.0, 2, 1, 250.0, m) == pytest.approx(0.05 + 50.0 / 250.0)
    # 16 ranks on 2 nodes: 14 steps in a node, 1 across, one of them inside alpha
    assert sm.ring_ms(0.0, 16, 2, 250.0, m) == pytest.approx((50 - 2 + 14 * 2 + 10) / 1e3)
    assert sm.ring_ms(100.0, 4, 1, 250.0, m, allreduce=True) == pytest.approx(
        (50 - 2 + 6 * 2) / 1e3 + 2 * 0.75 * 100 / 250
    )
    assert sm.ring_ms(5.0, 1, 1, 250.0, m) == 0.0
    sizes = sm.bucket_sizes(5665.2, 100)
    assert len(sizes) == 55 and sum(sizes) == pytest.approx(5665.2)
    assert sizes[-1] < sizes[0]
    # a collective shorter than the compute between buckets hides all but the last one
    assert sm.queue_behind([1.0] * 4, [1.0] * 4, 100.0) == pytest.approx(1.0)
    assert sm.queue_behind([50.0] * 4, [1.0] * 4, 100.0) == pytest.approx(200.0 - 75.0)
    assert sm.queue_ahead([1.0] * 4, [1.0] * 4, 100.0) == pytest.approx(1.0)


def test_hsdp_within_one_node_is_zero(cal):
    shape = sm.MODELS["1.4b"]
    for n in (2, 4, 8):
        zero = sm.predict(shape, sm.Layout(n, 8, False), cal.machine, cal.compute_ms)
        hsdp = sm.predict(shape, sm.Layout(n, 8, True), cal.machine, cal.compute_ms)
        assert zero == hsdp
    two_nodes = sm.predict(shape, sm.Layout(16, 8, True), cal.machine, cal.compute_ms)
    assert two_nodes.allreduce > 0 and two_nodes.optimizer == pytest.approx(
        sm.optimizer_ms(shape.params / 8, cal.machine)
    )
