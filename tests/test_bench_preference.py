"""scripts/bench_preference.py: hf_cp's shared-prompt layout against TRL's (prompt repeated per
answer, DPO rows padded, GRPO siblings on one rank), counted and priced by the same cost model."""

import pytest

from helpers import load_file_module

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (prompt, answers): prompt+answer rows are 15, 13 and 11, 5 tokens
TWO_GROUPS = [(10, (5, 3)), (4, (7, 1))]


@pytest.fixture(scope="module")
def bench():
    return load_file_module("bench_preference", "scripts/bench_preference.py")


@pytest.fixture(scope="module")
def cost():
    from hf_cp.cost.model import CostModel

    return CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")


def cluster(world, cap=32768):
    from hf_cp.plan.cluster import ClusterSpec

    return ClusterSpec(world, cap, 8)


def compare(bench, groups, kind, world, cost, **kw):
    from hf_cp.balance import get_balancer

    ids = list(range(len(groups)))
    return bench.compare_step(groups, ids, kind, cluster(world), cost, get_balancer("auto"), **kw)


def test_two_groups_count_the_prompt_once_against_per_answer_and_padding(bench, cost):
    # hf_cp: (10 + 5 + 3) + (4 + 7 + 1) = 30 tokens
    grpo = compare(bench, TWO_GROUPS, "grpo", 1, cost)
    assert grpo.hf_tokens == 30
    assert grpo.trl_tokens == grpo.trl_unpadded_tokens == 15 + 13 + 11 + 5  # the prompt once per answer
    # as GRPOTrainer pads one per-device batch of 8: 4 rows x (longest prompt 10 + longest completion 7)
    assert grpo.trl_padded_tokens == 4 * 17
    # DPO, one rank: 4 rows padded to the batch's longest (15)
    dpo1 = compare(bench, TWO_GROUPS, "dpo", 1, cost)
    assert (dpo1.hf_tokens, dpo1.trl_unpadded_tokens, dpo1.trl_tokens) == (30, 44, 60)
    # DPO, two ranks: one pair each, padded per rank's batch: 2 x 15 + 2 x 11
    dpo2 = compare(bench, TWO_GROUPS, "dpo", 2, cost)
    assert (dpo2.hf_tokens, dpo2.trl_tokens) == (30, 52)
    for r in (grpo, dpo1, dpo2):
        assert r.hf_tokens <= r.trl_unpadded_tokens <= r.trl_tokens
        assert r.hf_ms < r.trl_ms and r.lower_bound_ms <= r.hf_ms * (1 + 1e-9)
    # a batch closes when its padded rows would pass the cap: 2 x 2 x 15 > 40
    assert bench.dpo_micro_batches(TWO_GROUPS, cap=40, batch=8) == [[15, 15], [11, 11]]
    assert bench.dpo_micro_batches(TWO_GROUPS, cap=4096, batch=1) == [[15, 15], [11, 11]]
    assert bench.grpo_micro_batches(TWO_GROUPS, cap=28) == [[15, 13], [11, 5]]


def test_trl_layout_plan_is_what_it_prices(bench, cost):
    layout = bench.trl_layout(TWO_GROUPS * 2, 2, "grpo", 28, 8)
    assert layout == [[[15, 13], [11, 5]], [[15, 13], [11, 5]]]  # equal groups per rank, consecutive
    plan = bench.layout_plan(layout, 28).validate(cluster(2, 28), cost)
    assert sum(plan.lengths) == 2 * 44 and len(plan.waves) == 2
    assert all(g.size == 1 and not g.distributed for w in plan.waves for g in w.groups)
    with pytest.raises(ValueError, match="do not deal evenly"):
        bench.deal(TWO_GROUPS * 3, 4)


def test_planned_groups_balance_better_than_siblings_on_one_rank(bench, cost):
    """One long group (16 completions of 4,000 tokens) among 15 short ones at world 8: TRL's
    layout keeps its siblings on one rank; hf_cp spreads the group over a CP group."""
    groups = [(100, (4000,) * 16)] + [(20, (200,) * 16)] * 15
    r = compare(bench, groups, "grpo", 8, cost)
    assert r.trl_imbalance > 3.0  # rank 0 holds 64K of the step's 113K tokens
    assert r.hf_imbalance < 1.5 and r.hf_imbalance < r.trl_imbalance / 2
    assert r.hf_ms < r.trl_ms / 2
    assert r.hf_tokens == 100 + 64000 + 15 * (20 + 3200)
    assert r.trl_tokens == 16 * 4100 + 15 * 16 * 220


def test_a_slice_of_the_n8_trace(bench, cost, traces_dir):
    groups = bench.read_groups(traces_dir / "shared_prompt_alpaca_eval_n8.jsonl")[:16]
    assert all(len(a) == 8 for _, a in groups)
    r = compare(bench, groups, "grpo", 8, cost)
    assert r.hf_tokens == sum(p + sum(a) for p, a in groups)
    assert r.trl_tokens - r.hf_tokens == sum(7 * p for p, _ in groups)  # 7 extra copies of each prompt
    pairs = bench.dpo_pairs(groups)
    d = compare(bench, pairs, "dpo", 8, cost)
    assert d.hf_tokens == sum(p + a[0] + a[1] for p, a in groups)
    assert d.trl_tokens >= d.trl_unpadded_tokens == sum(2 * p + a[0] + a[1] for p, a in groups)
    long = bench.long_completions(groups, 8, 2000)
    assert max(max(a) for _, a in long) == 2000 and long[0][0] == groups[0][0]
    steps = bench.step_streams(len(groups), 24, 2, seed=0)  # 48 ids over 3 epochs of 16
    ids = [i for s in steps for i in s]
    assert [len(s) for s in steps] == [24, 24] and len(set(ids)) == 48 and max(ids) < 48


def test_a_small_run_writes_its_tables(bench, tmp_path, traces_dir):
    out = tmp_path / "preference.md"
    argv = ["--worlds", "8", "--steps", "1", "--traces-dir", str(traces_dir), "--write", "--out", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    assert "python scripts/bench_preference.py --worlds 8" in text
    for heading in ("## 1. Tokens computed", "## 2. GRPO: per-rank balance", "## Notes"):
        assert heading in text
    assert "## 3. Measured" not in text  # only with --measure
    assert "| GRPO G=16 | 8 |" in text and "| DPO pairs (n8: answers 0, 1) | 8 |" in text
