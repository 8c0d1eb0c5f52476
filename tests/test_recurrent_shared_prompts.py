"""Shared-prompt samples through a hybrid's recurrent layers (issue 36: DPO/GRPO on Qwen3-Next):
a sample [prompt][answer 1]...[answer n] trains as each [prompt][answer i] trained alone, with
the prompt's own tokens counted once. The reference runs every [prompt][answer i] through the
same weights with eager attention; the sample under test is packed with a plain document, kept
on one rank and spread over a real gloo CP group of 2 in every whole-document shard mode."""

from __future__ import annotations

import pytest
import torch
from test_recurrent_mixers import MODES, TOL, _documents, _models, _run_modes

from hf_cp.attention.recurrent import attach_recurrent_layers
from hf_cp.samples.masks import SampleMask

from helpers.attention_pool import pools, process_group  # noqa: F401  (pools: fixture)

PROMPT, ANSWERS = 9, (6, 11, 4)  # the local shared-prompt sample
SPREAD_PROMPT, SPREAD_ANSWERS = 14, (12, 9)  # the one spread over the group
PLAIN = 10  # a causal document beside them


def sample_tokens(seed: int, prompt: int, answers):
    """(prompt ids, [answer ids]) of one shared-prompt sample."""
    parts = _documents([prompt, *answers], seed=seed)
    return parts[0], parts[1:]


def labels_of(prompt_ids, answers):
    """The packed sample's labels: each prompt token predicts the next, each answer token the
    next of its answer; the prompt's last token and every answer's last predict nothing (the
    prompt's last would need one label per answer)."""
    out = [torch.cat([prompt_ids[1:], torch.tensor([-100])])]
    out += [torch.cat([a[1:], torch.tensor([-100])]) for a in answers]
    return torch.cat(out)


def reference(ref, samples, plain):
    """Loss and gradients with every [prompt][answer i] alone through the eager model (the
    prompt's own loss from the first answer's run only), and the plain document alone."""
    count = sum(len(p) - 1 + sum(len(a) - 1 for a in ans) for p, ans in samples) + len(plain) - 1
    ref.zero_grad()
    total = 0.0
    for p, ans in samples:
        for i, a in enumerate(ans):
            seq = torch.cat([p, a])
            logits = ref(input_ids=seq[None]).logits[0].float()
            lab = torch.cat([p[1:] if i == 0 else torch.full((len(p) - 1,), -100), torch.tensor([-100]), a[1:]])
            lab = torch.cat([lab, torch.tensor([-100])])
            loss = torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum") / count
            loss.backward()
            total += loss.item()
    logits = ref(input_ids=plain[None]).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits[:-1], plain[1:], reduction="sum") / count
    loss.backward()
    total += loss.item()
    return total, {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}, count


def _worker(rank, world, family, modes, sequential_answers=False):
    import hf_cp.attention.recurrent as recurrent

    group = process_group(list(range(world)))
    model, ref = _models(family)
    spread = sample_tokens(5, SPREAD_PROMPT, SPREAD_ANSWERS)
    local = sample_tokens(6, PROMPT, ANSWERS)
    plain = _documents([PLAIN], seed=7)[0]
    ref_loss, ref_grads, _ = reference(ref, [spread, local], plain)  # (_run_modes counts the labels)
    attach_recurrent_layers(model)
    spread_mask = SampleMask.shared_prompt(SPREAD_PROMPT, SPREAD_ANSWERS)
    local_mask = SampleMask.shared_prompt(PROMPT, ANSWERS)
    # the group's reference sequence: the spread sample, then rank 0's local sample, rank 1's plain one
    ids = torch.cat([spread[0], *spread[1], local[0], *local[1], plain])
    labels = torch.cat([labels_of(*spread), labels_of(*local), torch.cat([plain[1:], torch.tensor([-100])])])
    pos = torch.cat(
        [torch.as_tensor(spread_mask.position_ids()), torch.as_tensor(local_mask.position_ids()), torch.arange(PLAIN)]
    )
    distributed = [spread_mask.length]
    locals_per_member = [[local_mask.length], [PLAIN]]
    real_run = recurrent._run_document
    if sequential_answers:  # break it on purpose: every answer continues from the previous one's state
        recurrent._run_document = lambda forward, rows, mask, kwargs: recurrent._run(forward, rows, kwargs)
    try:
        return _run_modes(
            rank, world, model, ref_loss, ref_grads, ids, pos, labels, group, distributed, locals_per_member, modes,
            masks=(spread_mask,), local_masks=(local_mask,) if rank == 0 else (None,),
        )  # fmt: skip
    finally:
        recurrent._run_document = real_run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_shared_prompt_samples_train_like_each_answer_after_the_prompt(pools, family):
    rows = pools(2).run(_worker, family, MODES, timeout_s=180)
    assert {r["mode"] for r in rows} == {m.value for m in MODES}
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["err"] <= TOL, r


@pytest.mark.timeout(240)
def test_answers_run_one_after_another_are_caught(pools):
    rows = pools(2).run(_worker, "qwen3_next", MODES[:1], True, timeout_s=180)
    assert all(r["err"] > 1e-3 for r in rows), rows
