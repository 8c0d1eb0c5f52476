"""The pass sequences of parameter-sharded waves (plan/passes.py): every rank can follow the
merged sequence with dummies, and ranks with equal work run it at equal places."""

import itertools
import random

import pytest

from hf_cp.plan.passes import PassCursor, check_passes, chunked_passes, merge_passes


def test_chunked_passes_follow_chunkflows_schedule():
    # N forwards, then chunks last first: kept ones backward at once, the others recomputed first
    assert chunked_passes(1, 1) == "FB"
    assert chunked_passes(3, 1) == "ffF" + "B" + "FB" + "FB"
    assert chunked_passes(3, 3) == "FFFBBB"
    assert chunked_passes(4, 2) == "ffFF" + "BB" + "FBFB"
    with pytest.raises(ValueError, match="keep"):
        chunked_passes(2, 0)


@pytest.mark.parametrize("bad", ["B", "FBB", "FFB", "FX", "fB"])
def test_unbalanced_passes_are_refused(bad):
    with pytest.raises(ValueError):
        check_passes(bad)


def _follow(merged, own):
    """Run one rank through `merged`: returns (positions of its own passes, dummies run)."""
    cursor = PassCursor(merged, lambda graph: object(), lambda handle: None)
    places = []
    for kind in own:
        cursor.before(kind)
        places.append(cursor.pos - 1)
    cursor.finish()
    return places, cursor.dummy_count


def _patterns():
    singles = ["", "FB"] + [chunked_passes(n, k) for n in range(1, 5) for k in range(1, 5)]
    return singles + [a + b for a, b in itertools.product(singles[2:8], repeat=2)]


def test_every_rank_can_follow_the_merged_passes():
    rng = random.Random(0)
    pats = _patterns()
    for _ in range(400):
        own = [rng.choice(pats) for _ in range(rng.randint(1, 6))]
        merged = merge_passes(own)
        check_passes(merged)
        for p in own:
            places, dummies = _follow(merged, p)
            assert [merged[i] for i in places] == list(p)  # its own passes at places of their kind
            assert len(places) + dummies == len(merged)  # every place run exactly once
        # ranks with equal work meet at equal places (CP group members)
        assert _follow(merged, own[0])[0] == _follow(merged, own[0])[0]


def test_merged_passes_are_no_longer_than_needed_on_simple_waves():
    assert merge_passes(["FB", "", "FB"]) == "FB"
    assert merge_passes(["", ""]) == "FB"  # a wave runs at least one micro-batch everywhere
    assert merge_passes(["ffFBFBFB", "FB"]) == "ffFBFBFB"
    assert merge_passes(["FFBB", "ffFBFBFB"]) == "ffFFBFBFBB"


def test_a_rank_whose_work_does_not_fit_is_stopped_by_name():
    cursor = PassCursor("FB", lambda graph: object(), lambda h: None, where="step 3, wave 1")
    cursor.before("F")
    cursor.before("B")
    with pytest.raises(RuntimeError, match="step 3, wave 1"):
        cursor.before("F")
