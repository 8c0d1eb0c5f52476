"""What `hf-cp plan` and the planner read: lengths and masks from a lengths file, shared-prompt
records (the real traces) and saved datasets (mask column, pre-packed rows); masks reach the
balancer's request, and balancers that cannot price them refuse them by name."""

import json
import re

import pytest

from hf_cp.balance import (
    PlanRequest,
    UnsupportedMaskError,
    balancers_handling_masks,
    check_mask_support,
    get_balancer,
)
from hf_cp.cli import main
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.lengths import LengthsError
from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.plan_inputs import read_plan_inputs


def test_shared_prompt_trace_reads_as_masked_samples(traces_dir):
    path = traces_dir / "shared_prompt_alpaca_eval_n8.jsonl"
    got = read_plan_inputs(path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(got.lengths) == len(records) == 805
    for i, r in enumerate(records):
        assert got.lengths[i] == r["prompt"] + sum(r["answers"])
        assert got.masks[i] == SampleMask.shared_prompt(r["prompt"], r["answers"])
    # the trace README: packed groups have median 3,753 and max 11,967 tokens; sharing saves 6.6%
    assert max(got.lengths) == 11967 and sorted(got.lengths)[(805 - 1) // 2] == 3753
    separate = sum(len(r["answers"]) * r["prompt"] + sum(r["answers"]) for r in records)
    assert 1 - sum(got.lengths) / separate == pytest.approx(0.066, abs=0.0005)


def test_records_lengths_files_and_datasets(tmp_path):
    recs = tmp_path / "g.jsonl"
    recs.write_text('{"prompt": 3, "answers": [2, 4]}\n\n{"prompt": 5, "answers": [7]}\n')
    got = read_plan_inputs(recs)
    assert got.lengths == [9, 12] and got.masks == {0: SampleMask.shared_prompt(3, [2, 4])}  # one answer: causal
    plain = tmp_path / "l.txt"
    plain.write_text("# a comment\n5\n7\n")
    assert read_plan_inputs(plain).lengths == [5, 7] and read_plan_inputs(plain).masks == {}

    from datasets import Dataset

    m = SampleMask.prefix_lm(4, 2)
    rows = [{"input_ids": [1, 2, 3, 4], "length": 4, MASK_COLUMN: encode_mask(m)}, {"input_ids": [5], "length": 1}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = read_plan_inputs(tmp_path / "ds")
    assert got.lengths == [4, 1] and got.masks == {0: m}
    packed = [{"input_ids": list(range(9)), "seq_lengths": [4, 5]}, {"input_ids": [1, 2], "seq_lengths": [2]}]
    Dataset.from_list(packed).save_to_disk(str(tmp_path / "packed"))
    got = read_plan_inputs(tmp_path / "packed")
    assert got.lengths == [4, 5, 2] and "pre-packed" in got.kind


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": 3, "answers": [2]}\n{"prompt": 3}\n', r"g.jsonl, line 2: expected a record"),
        ('{"prompt": 3, "answers": [2, 0]}\n', r"line 1: prompt must be a token count >= 0 and answers a non-empty"),
        ('{"prompt": -1, "answers": [2]}\n', r"line 1: prompt must be"),
        ('{"prompt": 3, "answers": []}\n', r"line 1: prompt must be"),
        ('{"prompt": 3, "answers": [2]}\n{oops\n', r"line 2: not JSON"),
    ],
)
def test_bad_records_name_the_line(tmp_path, content, message):
    p = tmp_path / "g.jsonl"
    p.write_text(content)
    with pytest.raises(LengthsError, match=message):
        read_plan_inputs(p)


def test_bad_dataset_masks_and_boundaries_name_the_sample(tmp_path):
    from datasets import Dataset

    bad = [{"input_ids": [1, 2, 3], "length": 3, MASK_COLUMN: '{"kind": "block_causal", "length": 3, "block": 0}'}]
    Dataset.from_list(bad).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(LengthsError, match=r"sample 0 of dataset .*ds: block_causal block 0 must be at least 1"):
        read_plan_inputs(tmp_path / "ds")
    Dataset.from_list([{"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}]).save_to_disk(str(tmp_path / "p"))
    with pytest.raises(LengthsError, match=r"row 0 of dataset .*p: seq_lengths \[1, 1\] must be positive"):
        read_plan_inputs(tmp_path / "p")


def test_requests_carry_masks_and_balancers_that_cannot_price_them_refuse(h200_cost):
    cl = ClusterSpec(4, 4096)
    m = SampleMask.shared_prompt(10, [20, 30])
    req = PlanRequest([7, 8, 9], [60, 50, 40], cl, h200_cost, masks={7: m, 9: SampleMask.causal(40)})
    assert req.masks == {7: m}  # causal masks are dropped: those samples are causal
    assert PlanRequest([7], [60], cl, h200_cost, masks={}).masks is None
    with pytest.raises(ValueError, match=r"sample 8 has 50 tokens but its mask"):
        PlanRequest([7, 8], [60, 50], cl, h200_cost, masks={8: m})
    with pytest.raises(ValueError, match="sample 3, which is not in the step"):
        PlanRequest([7], [60], cl, h200_cost, masks={3: m})
    assert "static" in balancers_handling_masks()
    check_mask_support(get_balancer("static"), req)
    plan = get_balancer("static").plan(req).validate(cl, h200_cost)
    assert sorted(plan.sample_ids) == [7, 8, 9]
    for name in ("wlb", "skrull", "dynamic_cp"):
        with pytest.raises(UnsupportedMaskError, match=rf"balancer '{name}' prices every sample as a causal.*sample 7"):
            check_mask_support(get_balancer(name), req)
        check_mask_support(get_balancer(name), PlanRequest([8], [50], cl, h200_cost))  # no masks: nothing to refuse
    # auto plans a masked step with its members that price masks, and says so when it has none
    auto = get_balancer("auto")
    plan = auto.plan(req).validate(cl, h200_cost)
    assert plan.balancer.split(":")[1] in balancers_handling_masks()
    assert not set(auto.last_makespans) - set(balancers_handling_masks())
    with pytest.raises(UnsupportedMaskError, match=r"auto: none of its members \['wlb', 'skrull'\] plans masked"):
        get_balancer("auto", members=["wlb", "skrull"]).plan(req)


def test_planner_hands_masks_to_the_balancer_and_refuses_those_that_cannot(h200_cost):
    from hf_cp.planning import GlobalBatchSampler, Planner

    masks = {1: SampleMask.shared_prompt(3, [4, 5])}
    seen = []

    class Spy:
        name = "spy"
        handles_masks = True

        def plan(self, req):
            seen.append(req.masks)
            return get_balancer("static").plan(req)

    sampler = GlobalBatchSampler([10, 12, 9, 30], 40, shuffle=False)
    p = Planner(sampler, Spy(), ClusterSpec(2, 64), h200_cost, lookahead=0, masks=masks)
    for k in range(len(sampler)):
        p.get(k)
    assert seen == [{1: masks[1]} if 1 in sampler[k].sample_ids else None for k in range(len(sampler))]
    refusing = Planner(sampler, "wlb", ClusterSpec(2, 64), h200_cost, lookahead=0, masks=masks)
    with pytest.raises(UnsupportedMaskError, match="balancer 'wlb'"):
        refusing.get(0)


def test_cli_plans_the_shared_prompt_trace(capsys, traces_dir, tmp_path, h200_cost):
    from hf_cp.cost.bounds import lower_bound_ms

    trace = traces_dir / "shared_prompt_alpaca_eval_n8.jsonl"
    args = ["plan", "--lengths", str(trace), "--world", "8", "--steps", "2", "--balancer", "static"]
    assert main(args + ["--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "(805 samples, longest 11967; shared-prompt records, 805 with masks (shared_prompt))" in out
    got = json.loads((tmp_path / "p.json").read_text())
    plan, metrics = got["plans"][0], got["metrics"][0]
    lengths = [n for _, n in plan["samples"]]
    assert len(plan["masks"]) == len(lengths)  # the plan carries its samples' masks
    # the bound prices the shared prompts by their masked area: below the causal documents' bound
    causal = lower_bound_ms(lengths, ClusterSpec(8, 32768, h200_cost.profile.gpus_per_node), h200_cost)
    assert metrics["lower_bound_ms"] < 0.99 * causal
    assert main(args + ["--balancer", "wlb"]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"balancer 'wlb' prices every sample as a causal document.*Balancers that plan masked samples: .*static", err
    )
