"""Trainer-level exactness of the data paths: pre-packed rows train like their documents given
one per row (TRL's BFD packing), in one process and in two."""

import pytest

from helpers.masked_training import max_relative_error, one_step, run_processes
from helpers.packed_docs import docs_dataset


def packed_and_plain_rows(n_docs=23, seq_length=64):
    trl = pytest.importorskip("trl", reason="TRL is an optional extra (pip install 'hf_cp[trl]')")
    docs = docs_dataset(n_docs)
    packed = trl.pack_dataset(docs, seq_length=seq_length, strategy="bfd")
    return [dict(r) for r in packed], [dict(r) for r in docs]


def test_trl_packed_rows_train_like_their_documents_one_process(tmp_path):
    packed, plain = packed_and_plain_rows()
    a = one_step(packed, str(tmp_path / "packed"), cap=256)
    b = one_step(plain, str(tmp_path / "plain"), cap=256)
    assert a["history"][0]["num_samples"] == b["history"][0]["num_samples"] == len(plain)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert max_relative_error(a["grads"], b["grads"]) < 1e-5
    # the check can fail: the same rows read as one document each give another loss
    as_rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in packed]
    c = one_step(as_rows, str(tmp_path / "rows"), cap=256)
    assert abs(c["loss"] - b["loss"]) > 100 * abs(a["loss"] - b["loss"]) + 1e-5
    assert max_relative_error(c["grads"], b["grads"]) > 1e-2


@pytest.mark.slow
def test_trl_packed_rows_train_like_their_documents_two_processes(tmp_path):
    packed, plain = packed_and_plain_rows(n_docs=31)
    # a cap below the longest document: static zigzag-splits every pack over both ranks
    a = run_processes(dict(rows=packed, out=str(tmp_path / "packed"), cap=32), nproc=2)
    assert a["history"][0]["cp_size_samples"] == {"2": len(plain)}
    b = one_step(plain, str(tmp_path / "plain"), cap=4096)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert max_relative_error(a["grads"], b["grads"]) < 1e-5


# ----------------------------------------------------------------------------- shared-prompt samples
def shared_prompt_rows(seed=0, groups=((5, (4, 7, 3)), (9, (6, 2)), (0, (5, 4)), (3, (8,)))):
    """Grouped samples (prompt length, answer lengths) plus two causal ones; the prompts are
    untrained in half of them, a label inside an answer is masked here and there."""
    import numpy as np

    from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
    from hf_cp.samples.masks import SampleMask

    rng = np.random.default_rng(seed)
    rows, parts = [], []
    for g, (p, answers) in enumerate(groups):
        prompt = rng.integers(0, 256, p).tolist()
        ans = [rng.integers(0, 256, a).tolist() for a in answers]
        pl = [-100] * p if g % 2 == 0 else list(prompt)
        al = [[-100 if rng.random() < 0.15 else x for x in a] for a in ans]
        ids = prompt + [x for a in ans for x in a]
        labels = pl + [x for a in al for x in a]
        rows.append(
            {"input_ids": ids, "labels": labels, MASK_COLUMN: encode_mask(SampleMask.shared_prompt(p, answers))}
        )
        parts.append((prompt, pl, ans, al))
    for n in (11, 6):
        ids = rng.integers(0, 256, n).tolist()
        rows.append({"input_ids": ids, "labels": list(ids), MASK_COLUMN: None})
        parts.append(([], [], [ids], [list(ids)]))
    return rows, parts


def separate_sequences_reference(parts):
    """Loss and gradients of the tiny model (sdpa, one sequence per forward) trained on every
    (prompt, answer i) as its own sequence, the prompt's own targets counted once; written from
    the definition, without hf_cp's collator, targets or loss."""
    import torch
    import torch.nn.functional as F

    from helpers.masked_training import tiny_llama

    model = tiny_llama(0, attn="sdpa")
    model.train()
    terms, count = [], 0
    for prompt, pl, ans, al in parts:
        for i, (a, lab) in enumerate(zip(ans, al)):
            seq, labels = prompt + a, pl + lab
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
            first = 0 if i == 0 else max(len(prompt) - 1, 0)  # prompt targets only with the first answer
            for j in range(first, len(seq) - 1):
                if labels[j + 1] != -100:
                    terms.append(F.cross_entropy(logits[j], torch.tensor(labels[j + 1]), reduction="sum"))
                    count += 1
    loss = torch.stack(terms).sum() / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_shared_prompt_samples_train_like_separate_sequences_one_process(tmp_path):
    rows, parts = shared_prompt_rows()
    ref_loss, ref_grads = separate_sequences_reference(parts)
    got = one_step(rows, str(tmp_path / "grouped"), cap=256, eval_rows=rows)
    assert got["history"][0]["num_samples"] == len(rows)
    assert got["eval_loss"] == pytest.approx(ref_loss, rel=1e-6)  # planned evaluation, before the step
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert max_relative_error(got["grads"], ref_grads) < 1e-5


def test_masked_samples_need_the_hf_cp_attention(tmp_path):
    rows, _ = shared_prompt_rows()
    with pytest.raises(ValueError, match=r"step 1: its samples carry attention masks .* needs attn_implementation='hf_cp'"):
        one_step(rows, str(tmp_path / "sdpa"), cap=256, attn="sdpa")


@pytest.mark.parametrize(
    "world, balancer",
    [(2, "blocks_remote")]  # the fast representative: every block away from its query's owner
    + [
        pytest.param(w, b, marks=pytest.mark.slow)
        for w in (2, 4)
        for b in ("static", "blocks_identity", "blocks_random", "blocks_remote")
        if (w, b) != (2, "blocks_remote")
    ],
)
def test_shared_prompt_samples_train_like_separate_sequences_distributed(tmp_path, world, balancer):
    """Static zigzag-splits packs over the world (a cap below the longest sample); the block
    balancers place every sample's chunks over the world (identity, random permutation, every
    block executed away from its query's owner)."""
    rows, parts = shared_prompt_rows()
    ref_loss, ref_grads = separate_sequences_reference(parts)
    cap = 20 // world if balancer == "static" else 4096  # static: the longest sample (19) needs the whole world
    got = run_processes(dict(rows=rows, out=str(tmp_path / balancer), cap=cap, balancer=balancer), nproc=world)
    assert got["history"][0]["cp_size_samples"] == {str(world): len(rows)}  # every sample is distributed
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert max_relative_error(got["grads"], ref_grads) < 1e-5
