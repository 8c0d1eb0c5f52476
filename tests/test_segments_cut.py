"""modes.segments.cut finds its first document by bisection (issue 39: the simulator of a
4096-rank step of zigzag packs spent 14 s scanning packs from their first document). Checked
against a plain scan of the pack, written here."""

import random

from hf_cp.modes.segments import Segment, cut, doc_starts


def scanned(doc_lengths, begin, end):
    out, offset = [], 0
    for d, n in enumerate(doc_lengths):
        lo, hi = max(begin, offset), min(end, offset + n)
        if lo < hi:
            out.append(Segment(d, lo - offset, hi - lo))
        offset += n
    return out


def test_cut_equals_a_scan_of_the_pack_on_random_ranges():
    rng = random.Random(0)
    for _ in range(5000):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        total = sum(lengths)
        begin = rng.randint(0, total + 3)
        end = rng.randint(begin, total + 5)
        assert cut(lengths, begin, end) == scanned(lengths, begin, end), (lengths, begin, end)
        assert cut(lengths, begin, end, doc_starts(lengths)) == scanned(lengths, begin, end)


def test_doc_starts_end_with_the_pack_length():
    assert doc_starts([3, 5, 2]) == [0, 3, 8, 10]
