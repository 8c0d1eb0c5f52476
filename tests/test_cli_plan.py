import json
import re

import pytest

from hf_cp.cli import main


def run(capsys, *args):
    rc = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_static_on_code_trace_prints_report_and_plot(capsys, tmp_path, traces_dir):
    png = tmp_path / "timeline.png"
    rc, out, err = run(
        capsys,
        "--lengths",
        traces_dir / "code_numpy_files.txt",
        "--world",
        64,
        "--max-tokens-per-rank",
        32768,
        "--tokens-per-rank-per-step",
        65536,
        "--profile",
        "h200-qwen2.5-7b",
        "--model",
        "qwen2.5-7b",
        "--balancer",
        "static",
        "--steps",
        2,
        "--plot",
        png,
    )
    assert rc == 0, err
    assert "pred ms" in out and "bound ms" in out and "max/mean" in out and "cp-size" in out
    assert "predicted time / lower bound over 2 steps" in out
    assert png.stat().st_size > 20_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_json_is_byte_identical_and_resimulates(capsys, tmp_path, traces_dir):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--lengths", traces_dir / "longdoc_leval_multiturn.txt", "--world", 8, "--steps", 3]
    rc, _, err = run(capsys, *common, "--json", a)
    assert rc == 0, err
    assert run(capsys, *common, "--json", b)[0] == 0
    plans_a, plans_b = (json.dumps(json.loads(f.read_text())["plans"], sort_keys=True) for f in (a, b))
    assert plans_a == plans_b  # metrics differ only in the measured planner time
    planned = json.loads(a.read_text())["metrics"]
    rc, out, _ = run(capsys, "--plan-json", a)
    assert rc == 0 and "simulated 3 plan(s)" in out
    first = next(line for line in out.splitlines() if line.split() and line.split()[0] == "0")
    assert f"{planned[0]['predicted_ms']:.1f}" in first


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("100\n-5\n", ["--world", "8"], "line 2: length -5 must be positive"),
        ("100\nx\n", ["--world", "8"], "line 2: 'x' is not an integer"),
        ("100\n300000\n", ["--world", "8"], r"sample 1 \(line 2 of .*\) has 300000 tokens"),
        ("100\n", ["--world", "12"], "world_size 12 is not a power of two.*one node of at most 8 ranks"),
        ("100\n", ["--world", "8", "--balancer", "nope"], "unknown balancer 'nope'"),
        ("100\n", ["--world", "8", "--profile", "nope"], "no profile named 'nope'"),
    ],
)
def test_bad_input_gets_a_clear_error(capsys, tmp_path, content, args, message):
    p = tmp_path / "lengths.txt"
    p.write_text(content)
    rc, out, err = run(capsys, "--lengths", p, *args)
    assert rc == 2
    import re

    assert re.search(message, err), err


def test_plan_json_malformed(capsys, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "hf_cp.step_plan/1", "world_size": 2}))
    rc, _, err = run(capsys, "--plan-json", p)
    assert rc == 2 and "missing field" in err


def test_plan_prints_the_charged_bound_ring_bytes_and_the_pipeline_bubble(capsys, traces_dir):
    rc, out, err = run(
        capsys,
        "--lengths",
        traces_dir / "longdoc_leval_multiturn.txt",
        "--world",
        8,
        "--steps",
        2,
        "--pipeline-stages",
        4,
        "--chunk-size",
        8192,
    )
    assert rc == 0, err
    assert "charged" in out and "ring GB" in out and "predicted time / charged bound" in out
    table = out.split("bubble share of each step's micro-batches")[1].splitlines()
    assert "ChunkFlow, chunk 8192, K=1" in table[1]
    rows = [line.split() for line in table[2:4]]
    for row in rows:  # step, packs, bubble%, chunks, bubble%: equal chunks leave the smaller bubble here
        packs, chunks = int(row[1]), int(row[3])
        assert chunks > packs and float(row[4].rstrip("%")) < float(row[2].rstrip("%"))


def test_chunk_settings_reach_chunkflow_directly_and_as_auto_member():
    from hf_cp.planning import PlanningSettings

    s = PlanningSettings(balancer="chunkflow", chunk_size=512, chunk_keep=2)
    assert s.balancer_kwargs() == {"keep": 2, "chunk_size": 512}
    b = PlanningSettings(balancer="chunkflow", chunk_size=512, balancer_options={"keep": 3}).balancer_kwargs()
    assert b == {"keep": 3, "chunk_size": 512}  # an explicit option wins
    auto = PlanningSettings(balancer="auto", chunk_keep=2).balancer_kwargs()
    assert auto["member_options"]["chunkflow"] == {"keep": 2}
    # auto without chunkflow among its members gets no options for it (they would be refused)
    assert (
        "member_options"
        not in PlanningSettings(balancer="auto", balancer_options={"members": ["wlb"]}).balancer_kwargs()
    )
    with pytest.raises(ValueError, match="chunk_keep must be positive"):
        PlanningSettings(chunk_keep=0)


def test_a_sample_longer_than_the_world_is_planned_by_chunkflow_and_refused_by_static(capsys, tmp_path):
    # 10000 tokens, over 2 ranks x 4096: Qwen2.5-7B's K/V state store of it (1.6 GiB) and one
    # 4096-token chunk's activations fit one rank's cap
    p = tmp_path / "lengths.txt"
    p.write_text("100\n10000\n300\n")
    common = ["--lengths", p, "--world", "2", "--max-tokens-per-rank", "4096", "--compare-balancer", "none"]
    rc, out, err = run(capsys, *common, "--balancer", "static")
    assert rc == 2
    assert re.search(r"sample 1 \(line 2 of .*\) has 10000 tokens; the largest CP group .* holds 8192", err), err
    assert "or set cp_balancer: chunkflow" in err
    rc, out, err = run(capsys, *common, "--balancer", "chunkflow", "--json", tmp_path / "plans.json")
    assert rc == 0, err
    (plan,) = json.loads((tmp_path / "plans.json").read_text())["plans"]
    chunked = [c for w in plan["waves"] for g in w["groups"] for cs in g.get("chunked", {}).values() for c in cs]
    assert [c[0] for c in chunked] == [1]


def test_plans_on_groups_of_any_size_are_planned_and_resimulated_from_the_cli(capsys, tmp_path):
    """--balancer-opt any_size_groups=true registers every run of ranks inside a node (the step of
    tests/test_any_size_groups.py uses a group of 7); --plan-json reads such plans back."""
    lengths = tmp_path / "coarse.txt"
    lengths.write_text("\n".join(map(str, [86535, 71510, 148198, 142586, 18391])) + "\n")
    out_json = tmp_path / "plans.json"
    common = ["--lengths", lengths, "--world", 8, "--max-tokens-per-rank", 65536, "--tokens-per-step", 10**6]
    rc, _, err = run(
        capsys, *common, "--balancer", "dynamic_cp", "--balancer-opt", "any_size_groups=true", "--json", out_json
    )
    assert rc == 0, err
    sizes = {len(g["ranks"]) for w in json.loads(out_json.read_text())["plans"][0]["waves"] for g in w["groups"]}
    assert sizes - {1, 2, 4, 8}, f"no group of another size: {sizes}"
    rc, out, err = run(capsys, "--plan-json", out_json)
    assert rc == 0 and "simulated 1 plan(s)" in out, err
