"""Targets, positions and extra targets of masked samples, through the collator and the loss.

The reference is built from the definition of a shared-prompt sample, independently of
sample_targets.py: each (prompt, answer i) is its own causal sequence, and every target is a
(context, next token) pair; the prompt's own targets are counted once, the first token of every
answer once per answer. The packed sample must produce the same multiset of pairs, where a
row's context is the tokens its mask lets it see, in position order."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.modes.segments import ShardMode
from hf_cp.plan.block_layout import doc_slices, random_layout
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.targets import sample_targets, sample_valid_targets
from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator
from hf_cp.train.step.loss import chunked_lm_head_loss, logits_loss


def reference_pairs(prompt, answers, prompt_labels, answer_labels):
    """(context tuple, target) of every loss-carrying target of the n separate sequences."""
    out = Counter()
    P = len(prompt)
    for j in range(P - 1):  # the prompt's own targets, once
        if prompt_labels[j + 1] != IGNORE_INDEX:
            out[(tuple(prompt[: j + 1]), prompt_labels[j + 1])] += 1
    for a, al in zip(answers, answer_labels):
        seq, lab = list(prompt) + list(a), list(prompt_labels) + list(al)
        for j in range(max(P - 1, 0), len(seq) - 1):
            if lab[j + 1] != IGNORE_INDEX:
                out[(tuple(seq[: j + 1]), lab[j + 1])] += 1
    return out


def visible(mask: SampleMask):
    """Dense mask from the shared-prompt definition: causal, an answer sees the prompt and itself."""
    n, seg, start = mask.length, np.zeros(mask.length, dtype=int), mask.prompt
    for j, a in enumerate(mask.answers):
        seg[start : start + a] = j + 1
        start += a
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    return (k <= q) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == 0))


def packed_pairs(ids, mask, t):
    vis = visible(mask)
    out = Counter()
    ctx = lambda r: tuple(ids[k] for k in np.flatnonzero(vis[r]))  # noqa: E731
    for r, y in enumerate(t.shifted.tolist()):
        if y != IGNORE_INDEX:
            out[(ctx(r), y)] += 1
    for r, y in zip(t.extra_rows.tolist(), t.extra_tokens.tolist()):
        out[(ctx(r), y)] += 1
    return out


@st.composite
def shared_prompt_samples(draw):
    P = draw(st.integers(0, 6))
    answers = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    prompt = rng.integers(0, 50, P).tolist()
    ans = [rng.integers(0, 50, a).tolist() for a in answers]
    drop = draw(st.floats(0, 0.6))
    lab = lambda xs: [IGNORE_INDEX if rng.random() < drop else x for x in xs]  # noqa: E731
    masked_prompt = draw(st.booleans())
    pl = [IGNORE_INDEX] * P if masked_prompt else lab(prompt)
    return prompt, ans, pl, [lab(a) for a in ans]


@settings(max_examples=200, deadline=None)
@given(shared_prompt_samples())
def test_shared_prompt_targets_equal_separate_sequences_with_the_prompt_counted_once(sample):
    prompt, answers, pl, al = sample
    mask = SampleMask.shared_prompt(len(prompt), [len(a) for a in answers])
    ids = prompt + [x for a in answers for x in a]
    labels = pl + [x for a in al for x in a]
    t = sample_targets(ids, labels, mask)
    ref = reference_pairs(prompt, answers, pl, al)
    assert packed_pairs(ids, mask, t) == ref
    assert t.valid == sum(ref.values()) == sample_valid_targets(ids, labels, mask)
    # positions: every answer continues from the end of the prompt
    expect_pos = list(range(len(prompt))) + [len(prompt) + i for a in answers for i in range(len(a))]
    assert t.positions.tolist() == expect_pos
    assert (t.extra_tokens != IGNORE_INDEX).all()


def test_shared_prompt_example_and_one_answer_is_causal():
    m = SampleMask.shared_prompt(3, [2, 3])
    t = sample_targets([1, 2, 3, 4, 5, 6, 7, 8], None, m)
    assert t.shifted.tolist() == [2, 3, 4, 5, IGNORE_INDEX, 7, 8, IGNORE_INDEX]
    assert (t.extra_rows.tolist(), t.extra_tokens.tolist()) == ([2], [6])
    assert t.positions.tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    one = sample_targets([1, 2, 3, 4, 5], None, SampleMask.shared_prompt(3, [2]))
    causal = sample_targets([1, 2, 3, 4, 5])
    assert one.shifted.tolist() == causal.shifted.tolist() and one.positions.tolist() == [0, 1, 2, 3, 4]
    # other kinds change attention, not targets
    sw = sample_targets([1, 2, 3, 4, 5], None, SampleMask.sliding_window(5, 2))
    assert sw.shifted.tolist() == causal.shifted.tolist() and len(sw.extra_rows) == 0


@pytest.mark.parametrize("mode", list(ShardMode))
@pytest.mark.parametrize("size", [1, 2, 4])
def test_collator_puts_every_target_of_a_masked_sample_on_exactly_one_member(mode, size):
    masks = {0: SampleMask.shared_prompt(5, [4, 7, 3]), 2: SampleMask.shared_prompt(2, [1, 1, 9, 2])}
    rng = np.random.default_rng(0)
    rows = {s: rng.integers(0, 90, n).tolist() for s, n in [(0, 19), (1, 13), (2, 15), (3, 6)]}
    fetch = lambda s: (rows[s], None)  # noqa: E731
    blocks = None
    if mode == ShardMode.BLOCKS:  # chunks in a random permutation of owners
        blocks = random_layout([19, 13, 15], size, 4, doc_slices([19, 13, 15], [masks[0], None, masks[2]]), seed=3)
    group = Group(tuple(range(size)), [0, 1, 2], mode, {0: [3]}, blocks=blocks)
    plan = StepPlan(size, 1000, [0, 1, 2, 3], [19, 13, 15, 6], [Wave([group])], masks=masks)
    plan.validate()
    collate = PlanCollator(fetch, masks)
    got = Counter()
    valid = 0
    for r in range(size):
        mb = collate.micro_batch(plan, 0, plan.waves[0].groups[0], r)
        ctx = mb.context
        assert ctx.masks == (masks[0], None, masks[2]) and ctx.blocks is blocks
        assert ctx.local_masks == (() if r else ())  # sample 3 is causal
        assert mb.has_masks  # samples 0 and 2, distributed over the group
        valid += mb.num_valid
        ids, pos, y = mb.input_ids[0].tolist(), mb.position_ids[0].tolist(), mb.shift_labels[0].tolist()
        for i, p, t in zip(ids, pos, y):
            got[(p, i, t)] += 1
        for row, t in zip(mb.extra_rows.tolist(), mb.extra_targets.tolist()):
            got[(pos[row], ids[row], t)] += 1
    want = Counter()
    for s in (0, 1, 2, 3):
        t = sample_targets(rows[s], None, masks.get(s))
        for i, p, y in zip(rows[s], t.positions.tolist(), t.shifted.tolist()):
            want[(p, i, y)] += 1
        for row, y in zip(t.extra_rows.tolist(), t.extra_tokens.tolist()):
            want[(int(t.positions[row]), rows[s][row], y)] += 1
    assert got == want
    assert valid == sum(sample_valid_targets(rows[s], None, masks.get(s)) for s in rows)
    step = collate.rank_step(plan, 0, valid)
    assert step.has_masks and step.masked_samples == (0, 2)


def test_loss_adds_extra_targets_from_their_rows_hidden_state():
    torch.manual_seed(0)
    T, H, V = 11, 6, 17
    hidden = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    targets[[3, 7]] = IGNORE_INDEX
    rows, extra = torch.tensor([2, 2, 9, 0]), torch.tensor([5, 1, 16, 3])
    # reference: one cross-entropy per (row, target) pair, written out
    ref = 0
    for r, y in [(r, int(targets[r])) for r in range(T) if targets[r] != IGNORE_INDEX] + list(
        zip(rows.tolist(), extra.tolist())
    ):
        logp = torch.log_softmax(hidden[r] @ w.T, -1)
        ref = ref - logp[y]
    g_ref = torch.autograd.grad(ref, (hidden, w))
    for chunk in (1, 3, 64):
        got = chunked_lm_head_loss(hidden, w, targets, chunk, extra_rows=rows, extra_targets=extra)
        assert torch.allclose(got, ref, rtol=1e-12)
        for a, b in zip(torch.autograd.grad(got, (hidden, w)), g_ref):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    full = logits_loss(hidden @ w.T, targets, extra_rows=rows, extra_targets=extra)
    assert torch.allclose(full, ref, rtol=1e-12)
    without = chunked_lm_head_loss(hidden, w, targets, 4)
    assert not torch.allclose(without, ref)  # the extra targets count
    with pytest.raises(ValueError, match="extra_rows must index"):
        chunked_lm_head_loss(hidden, w, targets, 4, extra_rows=torch.tensor([T]), extra_targets=torch.tensor([1]))
    with pytest.raises(ValueError, match="given together"):
        logits_loss(hidden @ w.T, targets, extra_rows=rows)


def test_every_target_knows_its_answer():
    """[p0 p1 p2][a0 a1][b0 b1 b2]: the prompt's last row predicts a0 (answer 0) and, as an
    extra target, b0 (answer 1); prompt rows predicting prompt tokens and every answer's last
    row belong to no answer."""
    from hf_cp.samples.masks import SampleMask
    from hf_cp.samples.targets import sample_targets

    ids = [10, 11, 12, 20, 21, 30, 31, 32]
    labels = [-100, -100, -100, 20, 21, 30, 31, 32]
    t = sample_targets(ids, labels, SampleMask.shared_prompt(3, [2, 3]))
    assert t.answers.tolist() == [-1, -1, 0, 0, -1, 1, 1, -1]
    assert t.extra_rows.tolist() == [2] and t.extra_tokens.tolist() == [30] and t.extra_answers.tolist() == [1]
    # an answer whose first token carries no label: the prompt's last row predicts the next answer's
    labels = [-100, -100, -100, -100, 21, 30, 31, 32]
    t = sample_targets(ids, labels, SampleMask.shared_prompt(3, [2, 3]))
    assert t.shifted[2] == 30 and t.answers[2] == 1 and t.extra_answers.tolist() == []
    # a causal sample is one answer: every valid target is answer 0
    t = sample_targets([1, 2, 3], [-100, 2, 3])
    assert t.answers.tolist() == [0, 0, -1]
