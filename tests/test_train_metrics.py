"""What a CP run logs per logging interval: a fixed set of keys at any world size (the spread
over ranks and the slowest rank), with every rank's numbers left to the history files."""

import re
import statistics

import pytest

from hf_cp.train.measure.metrics import aggregate, summary_lines

from helpers.step_records import records


@pytest.mark.parametrize("world", [8, 64])
def test_a_log_line_keeps_the_spread_over_ranks_and_the_slowest_rank(world):
    recs = records(world)
    logs = aggregate(recs)
    assert not [k for k in logs if re.search(r"rank\d", k)], "no key per rank in a log line"
    assert len(logs) == len(aggregate(records(2, straggler=1))), "as many keys at any world size"
    mean = lambda f: statistics.mean(f(r) for r in recs)  # noqa: E731
    assert logs["cp/measured_max_ms"] == pytest.approx(mean(lambda r: max(r.measured_ms)))
    assert logs["cp/measured_mean_ms"] == pytest.approx(mean(lambda r: statistics.mean(r.measured_ms)))
    assert logs["cp/measured_min_ms"] == pytest.approx(mean(lambda r: min(r.measured_ms)))
    assert logs["cp/predicted_min_ms"] == pytest.approx(mean(lambda r: min(r.predicted_ms)))
    assert logs["cp/slowest_rank"] == 5 and logs["cp/world_size"] == world


def test_the_summary_lists_ranks_up_to_16_and_their_spread_beyond():
    few = "\n".join(summary_lines(records(8), "auto"))
    assert re.search(r"measured( \d+){8}$", few, re.M), few
    many = "\n".join(summary_lines(records(64), "auto"))
    assert "over 64 ranks: predicted min/mean/max" in many and "slowest rank 5" in many
    assert not re.search(r"measured( \d+){64}", many)
