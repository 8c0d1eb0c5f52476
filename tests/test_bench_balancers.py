"""scripts/bench_balancers.py: full steps are filled to the budget from a stream of epochs, and
the partial last step is reported apart."""

import pytest

from hf_cp.samples.lengths import read_lengths, step_batches

from helpers import load_file_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def bench():
    return load_file_module("bench_balancers", "scripts/bench_balancers.py")


def test_full_steps_follow_the_epoch_stream_and_fill_the_budget(bench, traces_dir):
    lengths = read_lengths(traces_dir / "chat_lmsys_chat1m_191conv.txt")  # 191 samples: a step holds many epochs
    n, budget = len(lengths), 65536 * 8
    steps = bench.full_step_ids(lengths, budget, 0, [0, 1, 4])
    assert sorted(steps) == [0, 1, 4]
    for ids in steps.values():
        assert len(set(ids)) == len(ids)  # an id per (epoch, sample)
        tokens = sum(lengths[i % n] for i in ids)
        assert budget - max(lengths) < tokens <= budget
    # inside the first epoch the stream is exactly the sampler's batches
    longdoc = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")
    first = bench.full_step_ids(longdoc, budget, 0, [0, 1])
    assert [first[0], first[1]] == step_batches(longdoc, budget, seed=0)[:2]


def test_a_small_run_reports_full_and_partial_steps_apart(bench, tmp_path, capsys):
    out = tmp_path / "b.md"
    argv = ["--worlds", "8", "--steps", "1", "--balancers", "static,dynamic_cp,auto"]
    argv += ["--traces", "chat_lmsys_chat1m_191conv", "--out", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    assert "## World 8, full steps" in text and "## World 8, the first epoch's partial last step" in text
    assert "pred/charged" in text and "`auto` planner CPU ms (median per step)" in text
    full = text.split("## World 8, full steps")[1].split("## World 8, the first")[0]
    assert "| chat_lmsys_chat1m_191conv | " in full and "auto (dynamic_cp)" in full
