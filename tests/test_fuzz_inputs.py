"""A deterministic fuzz of every kind of file hf_cp loads (issue 27's acceptance): seeded random
mutations of a valid file of each class, each known valid or invalid by construction, run
through the loader a user reaches:

    profiles          HardwareProfile.load (hf-cp plan --profile, cp_profile)
    grouped answers   hf-cp preprocess --group-answers (data_prep.preprocess, a tiny tokenizer)
    configs           hf-cp train CONFIG --dry-run --world 2 (hf_cp.cli.main: an exit code)
    checkpoints       a resume's checks (resolve_resume, check_resume) on a real tiny checkpoint
    history files     read_history / latest_records, the sample audit, hf-cp report
    plan JSON         StepPlan.load_file (hf-cp replay) and hf-cp plan --plan-json
    DeepSpeed JSON    the launch checks CPTrainer and the dry run call (checks/launch.py), world 2
    token data        read_token_columns with the model's vocabulary (CPTrainer's set-up)
    preference records  CPDPOTrainer's check of raw pairs (empty prompts and answers)
    lengths files     hf-cp plan --lengths (one token count a line)
    CLI flags         hf-cp plan's numeric flags (argparse's refusals count as clear: they name the flag)

Each input ends in one of:
    refused clearly        a project error (or a non-zero exit of the CLI) whose message names
                           the file or the mutated field
    accepted (valid)       a valid mutation, loaded
    accepted silently      an invalid mutation, loaded without an error
    traceback              any other exception (TypeError, KeyError, IndexError, numpy's, ...)
    hang                   still running after HANG_S (5 s; a SIGALRM deadline in the main thread)
    refused unclearly      refused, naming neither the file nor the field
    refused a valid input  a valid mutation refused
The last five fail the test; `pytest -s` prints the counts. A bigger sweep is marked slow.

Counts of the fast run (seed 27; refused clearly / accepted valid / accepted silently / traceback /
hang / refused unclearly / refused a valid input):
    profiles                 35: 24 / 11 / 0 / 0 / 0 / 0 / 0
    grouped-answer records   24: 20 /  4 / 0 / 0 / 0 / 0 / 0
    configs                  35: 30 /  5 / 0 / 0 / 0 / 0 / 0
    checkpoint files         24: 22 /  2 / 0 / 0 / 0 / 0 / 0   (half with the mark's SHA-256s, half without)
    history files            24: 15 /  9 / 0 / 0 / 0 / 0 / 0
    plan JSON                28: 25 /  3 / 0 / 0 / 0 / 0 / 0
    DeepSpeed JSON           24: 11 / 13 / 0 / 0 / 0 / 0 / 0
    token data               24: 17 /  7 / 0 / 0 / 0 / 0 / 0
    preference records       24: 12 / 12 / 0 / 0 / 0 / 0 / 0
    lengths files            24: 16 /  8 / 0 / 0 / 0 / 0 / 0
    CLI flags                24: 16 /  8 / 0 / 0 / 0 / 0 / 0
and of the slow sweep (run before the hang outcome was added): DeepSpeed JSON 80: 35 / 45; token data 160: 125 / 35; preference
records 160: 80 / 80; lengths files 160: 103 / 57; CLI flags 80: 53 / 27; profiles 171: 115 /
56; grouped-answer records 80: 61 / 19; checkpoint files 160: 143 / 17; history files 160: 122 / 38; plan JSON 164: 146 / 18; configs 91: 77 / 14
(every value of CONFIG_FIELDS in turn: 48 refused clearly, 16 accepted valid); none failing.
The profile, config and plan-JSON counts include their EXTREME_* tables (issue 40: numbers
that overflow, 0 heads, duplicate keys, an alias bomb, 100,000-deep nesting, a directory, a
world of 1,048,576), the last inputs of every run, fast or slow: 11, 11 and 4 of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
import signal
import string
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import yaml

from hf_cp.cli import main
from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.data_prep.encode import EncodeError
from hf_cp.data_prep.inputs import InputError
from hf_cp.plan.step_plan import PlanError, StepPlan
from hf_cp.report.runs import RunLogError
from hf_cp.report.samples import audit_samples
from hf_cp.resources import find_named
from hf_cp.samples.masks import MaskError
from hf_cp.train.checkpoint.integrity import CorruptCheckpointError
from hf_cp.train.checkpoint.marks import (
    COMPLETE_FILE,
    DIGESTS_FIELD,
    MARKED_FIELD,
    SCHEDULE_FILE,
    PartialCheckpointError,
    mark_complete,
)
from hf_cp.train.checkpoint.resolve import check_resume, resolve_resume
from hf_cp.train.checkpoint.schedule import ScheduleChangedError
from hf_cp.train.checkpoint.trust import UntrustedCheckpointError
from hf_cp.train.measure.step_record import HistoryError, latest_records
from hf_cp.train.setup.schema import TrainConfigError

from helpers.checkpoint_runs import train_with_checkpoints
from helpers.harness.models import ROOT

SEED = 27
FAST = 24  # inputs per class in the fast suite
SLOW = 160  # and in the slow sweep
TINY = ROOT / "configs" / "tiny-cpu.yaml"

CLEAR, VALID, SILENT, TRACEBACK = "refused clearly", "accepted (valid)", "accepted silently", "traceback"
HANG, UNCLEAR, FALSE_REFUSAL = "hang", "refused unclearly", "refused a valid input"
OUTCOMES = (CLEAR, VALID, SILENT, TRACEBACK, HANG, UNCLEAR, FALSE_REFUSAL)
FAILURES = (SILENT, TRACEBACK, HANG, UNCLEAR, FALSE_REFUSAL)
HANG_S = 5.0  # an input's deadline: the slowest input of the fast run takes well under 1 s


class Refused(Exception):
    """A CLI run that exited non-zero; the message is its stderr."""


class _Deadline(BaseException):
    """Raised by SIGALRM in an input past its deadline: a BaseException, so that a loader's own
    `except Exception` cannot swallow it."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise _Deadline in the main thread after `seconds`. pytest-timeout's own SIGALRM timer (its
    signal method) is set aside meanwhile and given back, less the time spent here."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def ring(signum, frame):
        raise _Deadline()

    before = signal.signal(signal.SIGALRM, ring)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3), interval)


@dataclass
class Case:
    what: str  # the mutation, for the report
    invalid: bool  # by construction
    names: Tuple[str, ...]  # a clear refusal names one of these (the file, the field)


@dataclass
class Tally:
    kind: str
    counts: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    bad: List[str] = field(default_factory=list)
    files_named: int = 0  # clear refusals whose message names the file itself (Case.names[0])
    deadline_s: float = HANG_S  # an input still running after it is a hang

    def judge(self, case: Case, call: Callable[[], object], errors: tuple) -> str:
        try:
            with _deadline(self.deadline_s):
                call()
        except _Deadline:
            outcome, detail = HANG, f"still running after {self.deadline_s:g} s"
        except (Refused, *errors) as e:
            text = str(e)
            if not case.invalid:
                outcome = FALSE_REFUSAL
            else:
                outcome = CLEAR if any(n and n in text for n in case.names) else UNCLEAR
                self.files_named += outcome == CLEAR and case.names[0] in text
            detail = f"{type(e).__name__}: {text.strip()[:300]}"
        except Exception as e:  # noqa: BLE001 (what the fuzz is after)
            outcome, detail = TRACEBACK, f"{type(e).__name__}: {str(e)[:300]}"
        else:
            outcome, detail = (SILENT if case.invalid else VALID), ""
        self.counts[outcome] += 1
        if outcome in FAILURES:
            self.bad.append(f"{case.what}: {outcome} ({detail})")
        return outcome

    def report(self) -> str:
        n = sum(self.counts.values())
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return f"fuzz {self.kind}: {n} inputs: {counts} (the file named in {self.files_named} refusals)"

    def check(self, messages: bool = True) -> None:
        """Fail on any input accepted silently, any traceback, any valid input refused and (with
        `messages`) any refusal that names neither the file nor the field."""
        print("\n" + self.report())
        for line in self.bad:
            print("  " + line)
        failures = FAILURES if messages else tuple(k for k in FAILURES if k != UNCLEAR)
        failed = {k: v for k, v in self.counts.items() if k in failures and v}
        assert not failed, self.report() + "\n" + "\n".join(self.bad)
        assert self.counts[CLEAR] and self.counts[VALID], f"{self.kind}: the fuzz must make valid and invalid inputs"


def test_an_input_past_its_deadline_is_a_hang_and_a_failure():
    """A loader stuck on an input (a read that never returns, a loop) counts as a hang, which fails
    the class; the timer is given back to pytest-timeout afterwards."""
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    tally = Tally("hangs", deadline_s=0.2)
    assert tally.judge(Case("sleeps", True, ("x",)), lambda: time.sleep(30), (ValueError,)) == HANG
    assert tally.judge(Case("swallows", True, ("x",)), _swallowing_loop, (ValueError,)) == HANG
    assert tally.judge(Case("quick", False, ("x",)), lambda: None, (ValueError,)) == VALID
    assert tally.counts[HANG] == 2 and "sleeps: hang (still running after 0.2 s)" in tally.bad[0]
    assert "hang 2" in tally.report()
    with pytest.raises(AssertionError, match="hang 2"):
        tally.check()
    if outer:  # pytest-timeout's signal method: its timer runs again
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= outer


def _swallowing_loop() -> None:
    """A loop whose own `except Exception` would swallow an ordinary exception."""
    while True:
        try:
            time.sleep(0.05)
        except Exception:  # noqa: BLE001 - what a loader might do
            pass


def _cli(args: Sequence[str]) -> None:
    """hf_cp.cli.main in this process; a non-zero exit raises Refused with its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    if rc != 0:
        raise Refused(err.getvalue() or f"exit {rc}")


def _typo(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return key[:i] + key[i + 1 :] if len(key) > 3 else key + "x"


def _key(d, k: str):
    """`k` as the key of `d`: a list index, or an integer key (YAML reads `8:` as 8)."""
    if isinstance(d, list) or (k.isdigit() and int(k) in d):
        return int(k)
    return k


def _get(d, path: str):
    for k in path.split("."):
        d = d[_key(d, k)]
    return d


def _set(d, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        d = d[_key(d, k)]
    d[_key(d, last)] = value


def _delete(d, path: str) -> None:
    *head, last = path.split(".")
    for k in head:
        d = d[k]
    del d[last]


def _number_ok(kind: str, v) -> bool:
    """Whether `v` is a valid value of a numeric field of `kind` (the test's own statement of
    the ranges, not the code under test's)."""
    if kind.startswith("optional "):
        return v is None or _number_ok(kind[len("optional ") :], v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if kind == "positive":
        return v > 0
    if kind == "nonneg":
        return v >= 0
    if kind == "posint":
        return v > 0 and float(v).is_integer()
    if kind == "share":
        return 0 < v < 1
    if kind == "efficiency":
        return 0 < v <= 1
    if kind == "factor":
        return v >= 1
    raise AssertionError(kind)


BAD_VALUES = [-1, 0, -2.5, 2.5, math.nan, math.inf, -math.inf, "fast", [1, 2], {"x": 1}, None, True]

# issue 40's extreme inputs, the same in every class that reads the format: text past any limit
DEEP_JSON = "[" * 100_000 + "]" * 100_000  # RecursionError in json.loads (and composing YAML)


def _alias_bomb(levels: int = 9) -> str:
    """A YAML "billion laughs": 9 levels of 9 aliases, 9^9 strings once expanded, from 1 KB."""
    anchors = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    anchors += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


def _extreme_file(f: Path, kind: str, payload, d, text: str) -> None:
    """Write an EXTREME_* case: `set` a field path of the parsed file `d` (dumped as YAML or JSON
    by the suffix), replace the `text` (payload(text)), or put a directory where the file goes."""
    if kind == "set":
        path, value = payload
        _set(d, path, value)
        f.write_text(json.dumps(d) if f.suffix == ".json" else yaml.safe_dump(d))
    elif kind == "text":
        f.write_text(payload(text))
    else:
        f.mkdir()


# ------------------------------------------------------------------ (a) profiles
PROFILE_FIELDS = {
    "c1_ms_per_token": "positive",
    "c2_ms_per_pair": "positive",
    "activation_bytes_per_token": "positive",
    "c0_ms": "nonneg",
    "static_bytes": "nonneg",
    "bytes_per_element": "posint",
    "gpus_per_node": "posint",
    "links.intra_node.bandwidth_gbps": "positive",
    "links.inter_node.bandwidth_gbps": "positive",
    "links.intra_node.latency_us": "nonneg",
    "links.inter_node.latency_us": "nonneg",
    "forward_share": "share",
    "cp_attention_scale": "positive",
    "reduction_overhead_ms": "nonneg",
    "step_overhead_ms": "nonneg",
    "cp_message_ms": "nonneg",
    "fitted_dims.hidden_size": "posint",
    "fitted_dims.num_hidden_layers": "posint",
    "fitted_dims.intermediate_size": "posint",
    "fitted_dims.num_key_value_heads": "optional posint",  # null in a config.json: as many as the heads
    "fitted_dims.head_dim": "optional posint",  # null: hidden size / heads
    "chunk_efficiency.8": "efficiency",
    "head_split_factor.2": "factor",
}
PROFILE_REQUIRED = [
    "c1_ms_per_token",
    "c2_ms_per_pair",
    "c0_ms",
    "fitted_dims",
    "activation_bytes_per_token",
    "static_bytes",
    "bytes_per_element",
    "gpus_per_node",
    "links",
    "links.inter_node",
    "fitted_dims.hidden_size",
]
PROFILE_OPTIONAL = ["chunk_efficiency", "head_split_factor", "description", "calibration", "name"]
# (what, set / text / dir, payload, invalid, the name a refusal gives): every fast run's last inputs
EXTREME_PROFILES = [
    ("c1_ms_per_token = 1e308 (inf, nan in hf-cp plan)", "set", ("c1_ms_per_token", 1e308), True, "c1_ms_per_token"),
    ("activation_bytes_per_token = 1e300 (a hang)", "set", ("activation_bytes_per_token", 1e300), True, "activation"),
    ("static_bytes = 1e300", "set", ("static_bytes", 1e300), True, "static_bytes"),
    ("gpus_per_node = 10**20", "set", ("gpus_per_node", 10**20), True, "gpus_per_node"),
    ("chunk_efficiency key 10**400", "set", ("chunk_efficiency", {10**400: 1.0}), True, "chunk_efficiency"),
    ("fitted_dims.num_attention_heads = 0", "set", ("fitted_dims.num_attention_heads", 0), True, "num_attention_heads"),
    ("c1_ms_per_token = 1000, its maximum", "set", ("c1_ms_per_token", 1000.0), False, ""),
    ("c0_ms given twice", "text", lambda t: t + "c0_ms: 2.0\n", True, "duplicate key 'c0_ms'"),
    ("an alias bomb in description", "text", lambda t: t + f"description: {_alias_bomb()}\n", True, "alias bomb"),
    ("100,000 nested lists", "text", lambda t: DEEP_JSON, True, "nested deeper"),
    ("a directory", "dir", None, True, "is a directory"),
]


def _profile_value(rng: random.Random, path: str, kind: str, base: dict):
    """A value for a numeric field: one of BAD_VALUES, or a valid one."""
    if rng.random() < 0.3:
        old = _get(base, path) if path.split(".")[0] in base else 1
        if kind.endswith("posint"):
            return old * 2 if path != "fitted_dims.num_key_value_heads" else 1  # 4 query heads: 1 divides them
        if kind in ("share", "efficiency"):
            return round(rng.uniform(0.01, 0.19), 3)  # below chunk_efficiency's 16-token 0.48: still rising
        if kind == "factor":
            return round(rng.uniform(1.0, 3.0), 3)
        return old * rng.choice([0.5, 2, 10]) if old else rng.choice([0.0, 1.5])
    return rng.choice(BAD_VALUES)


def profile_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    base = yaml.safe_load(find_named("cpu", "profiles", (".yaml",)).read_text())
    ops = ["value", "value", "value", "delete", "optional", "unknown", "file"]
    for i in range(n):
        d = json.loads(json.dumps(base))  # a deep copy
        f = tmp / f"profile{i}.yaml"
        op = ops[i % len(ops)]
        if op == "value":
            path, kind = rng.choice(sorted(PROFILE_FIELDS.items()))
            v = _profile_value(rng, path, kind, base)
            _set(d, path, v)
            valid = _number_ok(kind, v)
            case = Case(f"{path} = {v!r}", not valid, (str(f), path.split(".")[-1]))
        elif op == "delete":
            path = rng.choice(PROFILE_REQUIRED)
            _delete(d, path)
            case = Case(f"without {path}", True, (str(f), path.split(".")[-1]))
        elif op == "optional":
            path = rng.choice(PROFILE_OPTIONAL)
            d.pop(path, None)
            case = Case(f"without the optional {path}", False, (str(f), path))
        elif op == "unknown":
            section = rng.choice(["", "links.intra_node.", "fitted_dims."])
            known = sorted(_get(d, section[:-1]) if section else d)
            key = _typo(rng, rng.choice(known))
            while key in known:
                key += "s"
            _set(d, section + key, 1.0)
            valid = section == "fitted_dims."  # a transformers config.json: other keys are no concern
            case = Case(f"unknown key {section}{key}", not valid, (str(f), key))
        else:
            text = rng.choice(["", "[1, 2]\n", "c1_ms_per_token: [\n", "\x00\xff\xfe binary", "- c0_ms\n"])
            f.write_bytes(text.encode("latin-1"))
            yield Case(f"whole file {text!r}", True, (str(f),)), f
            continue
        f.write_text(yaml.safe_dump(d))
        yield case, f
    text = find_named("cpu", "profiles", (".yaml",)).read_text()
    for k, (what, kind, payload, invalid, name) in enumerate(EXTREME_PROFILES):
        f = tmp / f"profile-extreme{k}.yaml"
        _extreme_file(f, kind, payload, json.loads(json.dumps(base)), text)
        yield Case(what, invalid, (str(f), name)), f


def _profiles(n: int, tmp: Path) -> Tally:
    tally = Tally("profiles")
    rng = random.Random(SEED)
    for case, f in profile_inputs(rng, tmp, n):
        tally.judge(case, lambda f=f: HardwareProfile.load(f), (ConfigError,))
    return tally


def test_fuzz_profiles(tmp_path):
    _profiles(FAST, tmp_path).check()


# ------------------------------------------------------------------ (b) grouped-answer records
GROUP_BASE = [
    {"prompt": "What is the capital of France?", "answers": [" Paris.", " Lyon", " It is Paris."]},
    {"prompt": "Name a prime.", "answers": [" 7", " 11"]},
    {"prompt": "Say hi", "answers": [" hi"]},
]
CHAT_BASE = [
    {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "answers": [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]],
    },
    {"prompt": [{"role": "user", "content": "Sky?"}], "answers": [[{"role": "assistant", "content": "Blue."}]]},
]
PREFERENCE_BASE = [
    {"prompt": "Best colour?", "chosen": " Blue.", "rejected": " Beige."},
    {"prompt": "2+2?", "chosen": " 4", "rejected": " 5"},
]
BAD_ANSWERS = ["one answer as text", [], [3], [None], [" ok", 5], 7, [[{"role": "assistant"}]], [{"content": "x"}]]
BAD_PROMPTS = [5, None, [], [{"role": "user"}], [{"content": "hi"}], 2.5]


def group_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    ops = ["answers", "prompt", "missing", "valid", "chat", "preference", "file", "answers"]
    for i in range(n):
        f = tmp / f"groups{i}.jsonl"
        op = ops[i % len(ops)]
        recs = json.loads(json.dumps(GROUP_BASE))
        j = rng.randrange(len(recs))
        text = None
        if op == "answers":
            v = rng.choice(BAD_ANSWERS)
            recs[j]["answers"] = v
            case = Case(f"record {j}: answers = {v!r}", True, (str(f), "answers", "answer "))
        elif op == "prompt":
            v = rng.choice(BAD_PROMPTS)
            recs[j]["prompt"] = v
            case = Case(f"record {j}: prompt = {v!r}", True, (str(f), "prompt"))
        elif op == "missing":
            key = rng.choice(["prompt", "answers"])
            del recs[j][key]
            case = Case(f"record {j} without {key}", True, (str(f), key))
        elif op == "valid":
            what = rng.choice(["extra field", "empty answer", "responses", "unicode", "long answers"])
            if what == "extra field":
                recs[j]["source"] = "web"
            elif what == "empty answer":
                recs[j]["answers"].append("")  # its EOS token is its one token
            elif what == "responses":
                recs = [{"prompt": r["prompt"], "responses": r["answers"]} for r in recs]
            elif what == "unicode":
                recs[j]["prompt"] = "Ça va? 你好 🙂"
            else:
                recs[j]["answers"] = [" " + "".join(rng.choices(string.ascii_letters, k=200)) for _ in range(3)]
            case = Case(f"valid: {what}", False, (str(f),))
        elif op == "chat":
            recs = json.loads(json.dumps(CHAT_BASE))
            j = rng.randrange(len(recs))
            bad = rng.choice(["prompt message without content", "answer message without content", None])
            if bad == "prompt message without content":
                del recs[j]["prompt"][0]["content"]
            elif bad == "answer message without content":
                del recs[j]["answers"][0][0]["content"]
            case = Case(f"chat: {bad or 'valid'}", bad is not None, (str(f), "prompt", "answer", "content"))
        elif op == "preference":
            recs = json.loads(json.dumps(PREFERENCE_BASE))
            j = rng.randrange(len(recs))
            bad = rng.choice(["rejected", "chosen", None])
            if bad:
                recs[j][bad] = rng.choice([None, 3])
            case = Case(f"preference pair: {bad or 'valid'} changed", bad is not None, (str(f), "answer", bad or "-"))
        else:
            text = rng.choice(["", "{not json\n", json.dumps(GROUP_BASE) + "\n", "\n\n", '"a string"\n', "[1, 2]\n"])
            # one JSON array of the records: datasets reads it as the same rows
            case = Case(f"whole file {text[:30]!r}", not text.startswith("[{"), (str(f),))
        f.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in recs))
        yield case, f


def _groups(n: int, tmp: Path) -> Tally:
    import datasets

    from hf_cp.data_prep import preprocess

    from helpers.tiny_tokenizer import tiny_chat_tokenizer

    datasets.disable_progress_bars()
    tok = tiny_chat_tokenizer()
    tally = Tally("grouped-answer records")
    rng = random.Random(SEED)
    for case, f in group_inputs(rng, tmp, n):
        tally.judge(case, lambda f=f: preprocess(str(f), tok, None, group_answers=True), (EncodeError, InputError))
    return tally


def test_fuzz_grouped_answer_records(tmp_path):
    _groups(FAST, tmp_path).check()


# ------------------------------------------------------------------ (c) training configs
CONFIG_FIELDS = {
    # key: (invalid values, valid values)
    "training.learning_rate": ([-1.0, "fast", [0.1], math.nan, math.inf], [1e-4]),
    "training.num_train_epochs": ([-1, "three", [3]], [1]),
    "training.cp_max_tokens_per_rank": ([0, -4096, 100.5, "big", [4096]], [8192]),
    "training.cp_tokens_per_step": ([0, -1, "x", 0.5], [16384]),
    "training.cp_balancer": (["nope", 3, ["auto"]], ["static"]),
    "training.cp_profile": (["nope", 5], ["h200-qwen2.5-7b"]),
    "training.cp_plan_lookahead": ([-1, "x"], [0]),
    "training.warmup_steps": ([-2, "x"], [0]),
    "training.weight_decay": (["x", math.nan, -1.0], [0.1]),
    "training.max_grad_norm": (["x", [1]], [0.5]),
    "training.lr_scheduler_type": (["sometimes", 3], ["linear"]),
    "training.save_strategy": (["sometimes"], ["epoch"]),
    "training.seed": (["x", 1.5], [7]),
    "training.logging_steps": (["x", -5], [4]),
    "model.config": (["nope", 5], []),
    "model.seed": (["x", 1.5], [3]),
    "data.bundled": (["nope", 7], []),
    "data.eval_split": ([1.5, -0.1, "x", 0.0], [0.1]),
}


# (what, set / text / dir, payload, invalid, the name a refusal gives): every fast run's last inputs
EXTREME_CONFIGS = [
    ("training.max_steps = 1e20", "set", ("training.max_steps", 1e20), True, "training.max_steps"),
    ("training.max_steps = 10**20 (an OverflowError)", "set", ("training.max_steps", 10**20), True, "max_steps"),
    ("training.num_train_epochs = 1e20 (a hang)", "set", ("training.num_train_epochs", 1e20), True, "num_train_epochs"),
    ("model.seed = 10**30", "set", ("model.seed", 10**30), True, "model.seed"),
    (
        "training.cp_max_tokens_per_rank = 10**15 (a hang)",
        "set",
        ("training.cp_max_tokens_per_rank", 10**15),
        False,
        "",
    ),
    ("model.config with 0 attention heads", "set", ("model.config", "heads0"), True, "num_attention_heads"),
    ("two training sections", "text", lambda t: t + "training:\n  max_steps: 1\n", True, "duplicate key 'training'"),
    (
        "training.seed given twice",
        "text",
        lambda t: t.replace("  seed: 0\n  num", "  seed: 0\n  seed: 1\n  num"),
        True,
        "'seed'",
    ),
    (
        "an alias bomb in training.output_dir",
        "text",
        lambda t: t.replace("output_dir: outputs/tiny-cpu", "output_dir: " + _alias_bomb()),
        True,
        "alias bomb",
    ),
    ("100,000 nested lists", "text", lambda t: DEEP_JSON, True, "nested deeper"),
    ("a directory", "dir", None, True, "is a directory"),
]


def config_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    base = yaml.safe_load(TINY.read_text())
    ops = ["value", "value", "value", "valid", "unknown", "structure"]
    for i in range(n):
        d = json.loads(json.dumps(base))
        f = tmp / f"config{i}.yaml"
        op = ops[i % len(ops)]
        text = None
        if op in ("value", "valid"):
            options = sorted(CONFIG_FIELDS.items())
            if op == "valid":
                options = [o for o in options if o[1][1]]
            path, (bad, good) = rng.choice(options)
            v = rng.choice(bad if op == "value" else good)
            _set(d, path, v)
            case = Case(f"{path} = {v!r}", op == "value", (str(f), f.name, path.split(".")[-1]))
        elif op == "unknown":
            section = rng.choice(["training", "model", "data"])
            key = _typo(rng, rng.choice(sorted(d[section])))
            d[section][key] = 1
            case = Case(f"unknown key {section}.{key}", True, (str(f), f.name, key))
        else:
            what = rng.choice(["training list", "model number", "no model", "no data", "section", "file"])
            if what == "training list":
                d["training"] = [1, 2]
            elif what == "model number":
                d["model"] = 5
            elif what in ("no model", "no data"):
                del d[what.split()[1]]
            elif what == "section":
                d["trainer"] = {"x": 1}
            else:
                text = rng.choice(["", "[1]\n", "training: [\n", "\x00\xff binary"])
                what = f"file {text!r}"
            case = Case(what, True, (str(f), f.name, "model", "data", "training", "trainer"))
        if text is not None:
            f.write_bytes(text.encode("latin-1"))
        else:
            f.write_text(yaml.safe_dump(d))
        yield case, f
    heads0 = tmp / "heads0.json"
    heads0.write_text(
        json.dumps(dict(json.loads(find_named("tiny-llama", "models", (".json",)).read_text()), num_attention_heads=0))
    )
    for k, (what, kind, payload, invalid, name) in enumerate(EXTREME_CONFIGS):
        f = tmp / f"config-extreme{k}.yaml"
        payload = (payload[0], str(heads0)) if payload == ("model.config", "heads0") else payload
        _extreme_file(f, kind, payload, json.loads(json.dumps(base)), TINY.read_text())
        yield Case(what, invalid, (str(f), name)), f


def _configs(n: int, tmp: Path) -> Tally:
    tally = Tally("configs")
    rng = random.Random(SEED)
    out = tmp / "out"
    for case, f in config_inputs(rng, tmp, n):
        args = ["train", f, "--dry-run", "--world", "2", "--dry-run-steps", "1", "--set", f"training.output_dir={out}"]
        tally.judge(case, lambda args=args: _cli(args), (TrainConfigError, ConfigError))
    return tally


def test_fuzz_configs(tmp_path):
    """Every refusal names the key (or the file): names are checked when the config is read
    (model.config, cp_profile, cp_balancer), enum strings against the enum, numbers against
    config_schema's TRAINING_RANGES, and errors of building CPTrainingArguments or the model config
    come with the file and section.key before them (config.named_errors)."""
    _configs(FAST, tmp_path).check()


# slow: a launch sample of the config class, as for DeepSpeed JSON below: what the dry run accepts must train
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fuzz_configs_accepted_by_the_dry_run_train(tmp_path):
    """Every distinct config input (by the key it changes) that `hf-cp train --dry-run --world 2`
    accepts trains one step under `hf-cp train --nproc 2`."""

    accepted, seen = [], set()
    for case, f in config_inputs(random.Random(SEED), tmp_path, 120):
        key = case.what.split(" = ")[0]
        if case.invalid or key in seen or "hang" in case.what:
            continue
        try:
            _cli(["train", f, "--dry-run", "--world", "2", "--dry-run-steps", "1",
                  "--set", f"training.output_dir={tmp_path / 'dry'}"])  # fmt: skip
        except Refused:
            continue
        seen.add(key)
        accepted.append((case, f))
    assert len(accepted) >= 4, [c.what for c, _ in accepted]
    failed = [e for case, f in accepted[:10] if (e := _launch_one_step(case, f, tmp_path / f.stem))]
    assert not failed, "\n".join(failed)


def _launch_one_step(case: Case, config: Path, out: Path, *sets: str) -> Optional[str]:
    """One step of `config` under `hf-cp train --nproc 2` (training.`sets` too, no saving or
    evaluation): None when it trained, else the case and the end of its stderr."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hf_cp", "train", str(config), "--nproc", "2"]
    for o in ("max_steps=1", *sets, f"output_dir={out}", "save_strategy=no", "cp_save_final_model=false",
              "eval_strategy=no"):  # fmt: skip
        cmd += ["--set", f"training.{o}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)
    print(f"launch {case.what}: rc {proc.returncode}")
    return None if proc.returncode == 0 else f"{case.what}: {proc.stderr[-1500:]}"


# ------------------------------------------------------------------ (d) checkpoint files
def _train(out: Path, steps: int) -> None:
    """A world-1 CPTrainer without DeepSpeed on LENGTHS, a checkpoint every 2 steps (~5 s)."""
    train_with_checkpoints(out, steps)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """checkpoint-2 of a world-1 run (the Trainer's files), with a ZeRO-2 folder as 2 ranks
    save it (torch.save archives), marked complete; and the run's history."""
    import torch

    out = tmp_path_factory.mktemp("fuzz") / "run"
    _train(out, 2)
    ckpt = out / "checkpoint-2"
    zero = ckpt / "global_step2"
    zero.mkdir()
    torch.save({"module": {"w": torch.arange(16.0)}, "ds_version": "0.19"}, zero / "mp_rank_00_model_states.pt")
    for r in range(2):
        state = {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.full((8,), float(r))}}}}
        torch.save(state, zero / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (ckpt / "latest").write_text("global_step2")
    mark_complete(ckpt, 2, 1)
    return out


def _pickle_span(path: Path) -> Tuple[int, int]:
    """Byte range of a torch archive's data.pkl (guarded by its CRC-32)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with open(path, "rb") as fh:  # the local header's name and extra field (torch pads it) precede the data
        fh.seek(info.header_offset + 26)
        head = fh.read(4)
    start = info.header_offset + 30 + int.from_bytes(head[:2], "little") + int.from_bytes(head[2:], "little")
    return start, start + info.compress_size


def _safetensors_loads(path: Path) -> bool:
    from safetensors.torch import load_file

    try:
        load_file(str(path))
        return True
    except Exception:  # noqa: BLE001 (the oracle: any failure)
        return False


TRAINER_STATE_EDITS = [
    # (what, edit of the state dict or None to replace it, invalid)
    ("global_step = '2'", lambda s: s.update(global_step="2"), True),
    ("global_step = -1", lambda s: s.update(global_step=-1), True),
    ("global_step = 2.5", lambda s: s.update(global_step=2.5), True),
    ("global_step = null", lambda s: s.update(global_step=None), True),
    ("without global_step", lambda s: s.pop("global_step"), True),
    ("unknown field", lambda s: s.update(global_stepp=2), True),
    ("log_history = 'x'", lambda s: s.update(log_history="x"), True),
    ("log_history = [1]", lambda s: s.update(log_history=[1]), True),
    ("epoch = NaN", lambda s: s.update(epoch=math.nan), True),
    ("epoch = 'one'", lambda s: s.update(epoch="one"), True),
    ("stateful_callbacks = [1]", lambda s: s.update(stateful_callbacks=[1]), True),
    ("best_metric = 0.5", lambda s: s.update(best_metric=0.5), False),
    ("another log entry", lambda s: s["log_history"].append({"loss": 1.0, "step": 2}), False),
    ("only global_step", lambda s: [s.pop(k) for k in list(s) if k != "global_step"], False),
]


def checkpoint_inputs(rng: random.Random, run: Path, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    src = run / "checkpoint-2"
    parts = sorted(
        p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and p.name not in (COMPLETE_FILE,)
    )
    binary = [p for p in parts if p.endswith((".pt", ".pth", ".bin", ".safetensors"))]
    ops = ["truncate", "empty", "garbage", "flip", "state", "state", "delete", "append", "latest"]
    for i in range(n):
        out = tmp / f"run{i}"
        ckpt = out / "checkpoint-2"
        shutil.copytree(src, ckpt)
        op = ops[i % len(ops)]
        part = rng.choice(binary if op in ("flip", "append") else parts)
        if op == "state":
            part = "trainer_state.json"
        elif op == "latest":
            part = "latest"
        p = ckpt / part
        data = p.read_bytes()
        names = (str(p), part)
        if op == "truncate":
            p.write_bytes(data[: rng.randrange(len(data))])
            case = Case(f"{part} cut to {p.stat().st_size} of {len(data)} bytes", True, names)
        elif op == "empty":
            p.write_bytes(b"")
            case = Case(f"{part} emptied", True, names)
        elif op == "garbage":
            p.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
            case = Case(f"{part} replaced by random bytes", True, names)
        elif op == "flip":
            if part.endswith(".safetensors"):
                at = rng.randrange(8 + int.from_bytes(data[:8], "little"))  # in the length or the JSON header
            else:
                at = rng.randrange(*_pickle_span(p))
            p.write_bytes(data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :])
            invalid = not part.endswith(".safetensors") or not _safetensors_loads(p)
            case = Case(f"{part}: a bit flipped at byte {at}", invalid, names)
        elif op == "state":
            what, edit, invalid = rng.choice(TRAINER_STATE_EDITS)
            state = json.loads(data)
            edit(state)
            p.write_text(json.dumps(state))
            case = Case(f"trainer_state.json: {what}", invalid, names)
        elif op == "delete":
            p.unlink()
            case = Case(f"{part} deleted", True, names)  # every part is listed by the completion mark
        elif op == "append":
            p.write_bytes(data + b"\x00trailing")
            # torch.load reads past trailing bytes; safetensors must cover its file exactly
            case = Case(f"{part}: bytes appended", part.endswith(".safetensors"), names)
        else:
            tag = rng.choice(["global_step9", "", "../elsewhere", "global_step2\n"])
            p.write_text(tag)
            case = Case(f"latest = {tag!r}", tag.strip() != "global_step2", names)
        changed = not p.is_file() or p.read_bytes() != data
        if i % 2 == 0:  # its mark records SHA-256s: any change is refused, by checksum
            case = replace(case, what=case.what + " (checksummed)", invalid=case.invalid or changed)
        else:  # a mark of an hf_cp from before checksums: the format is what is checked
            record = json.loads((ckpt / COMPLETE_FILE).read_text())
            record.pop(DIGESTS_FIELD)
            (ckpt / COMPLETE_FILE).write_text(json.dumps(record))
        yield case, ckpt


def _checkpoints(n: int, run: Path, tmp: Path) -> Tally:
    tally = Tally("checkpoint files")
    rng = random.Random(SEED)
    schedule = json.loads((run / "checkpoint-2" / SCHEDULE_FILE).read_text())
    schedule.pop(MARKED_FIELD, None)

    def resume(ckpt: Path) -> None:
        found = resolve_resume(str(ckpt), str(ckpt.parent), notes=[])
        check_resume(found, schedule, 1, None)

    errors = (CorruptCheckpointError, PartialCheckpointError, ScheduleChangedError, UntrustedCheckpointError)
    for case, ckpt in checkpoint_inputs(rng, run, tmp, n):
        tally.judge(case, lambda ckpt=ckpt: resume(ckpt), errors)
    return tally


def test_fuzz_checkpoint_files(saved_run, tmp_path):
    _checkpoints(FAST, saved_run, tmp_path).check()


# ------------------------------------------------------------------ (e) history files
HISTORY_FIELDS = {
    # field: kind (int, float, str, optional ..., lists, objects)
    "index": "count",
    "epoch": "count",
    "global_step": "count",
    "num_samples": "count",
    "waves": "count",
    "attempt": "count",
    "loss": "float",
    "step_wall_ms": "float",
    "planner_ms": "float",
    "measured_ms": "rank floats",
    "predicted_ms": "rank floats",
    "rank_tokens": "ints",
    "wave_max_ms": "floats",
    "plan_digest": "str",
    "balancer": "str",
    "rank": "optional count",
    "resumed_from": "optional count",
    "dataset_samples": "optional count",
    "data_epoch": "optional float",
    "compare_step_ms": "optional float",
    "compare_balancer": "optional str",
    "plan_notes": "strs",
    "cp_size_samples": "sizes",
    "trained_sample_ids": "optional ints",
    "step_span": "optional floats",
}
HISTORY_VALUES = ["x", [1.0], {"2": 1}, None, -1, 1.5, True, [], ["x"], {"a": 1}, 3, 0.25, [1.0, 2.0]]
HISTORY_REQUIRED = ["index", "epoch", "loss", "measured_ms", "predicted_ms", "plan_digest", "waves"]


def _history_value_ok(kind: str, v) -> bool:
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    whole = isinstance(v, int) and not isinstance(v, bool)
    if kind.startswith("optional "):
        return v is None or _history_value_ok(kind[len("optional ") :], v)
    return {
        "count": whole and v >= 0,
        "float": number,
        "str": isinstance(v, str),
        "rank floats": isinstance(v, list) and len(v) == 2 and all(isinstance(x, float) for x in v),
        "floats": isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
        "ints": isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "strs": isinstance(v, list) and all(isinstance(x, str) for x in v),
        "sizes": isinstance(v, dict) and all(k.isdigit() and isinstance(x, int) for k, x in v.items()),
    }[kind]


def history_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    from helpers.step_records import records

    base = [r.for_rank(0, [2 * k, 2 * k + 1], [0.0, 1.0]).to_dict() for k, r in enumerate(records(world=2))]
    for r in base:
        r["dataset_samples"] = 8
    ops = ["value", "value", "value", "delete", "line", "valid"]
    for i in range(n):
        run = tmp / f"run{i}"
        (run / "cp_history").mkdir(parents=True)
        f = run / "cp_history" / "rank0.jsonl"
        recs = json.loads(json.dumps(base))
        k = rng.randrange(len(recs) - 1)  # not the last line: a torn last line is skipped on purpose
        lines = None
        op = ops[i % len(ops)]
        if op == "value":
            key, kind = rng.choice(sorted(HISTORY_FIELDS.items()))
            v = rng.choice(HISTORY_VALUES)
            recs[k][key] = v
            case = Case(f"line {k + 1}: {key} = {v!r}", not _history_value_ok(kind, v), (str(f), key))
        elif op == "delete":
            key = rng.choice(HISTORY_REQUIRED)
            del recs[k][key]
            case = Case(f"line {k + 1} without {key}", True, (str(f), key))
        elif op == "line":
            bad = rng.choice(["{not json", "[1, 2]", '"text"', "null", json.dumps(recs[k])[:40]])
            lines = [json.dumps(r) for r in recs]
            lines[k] = bad
            case = Case(f"line {k + 1} = {bad!r}", True, (str(f),))
        else:
            what = rng.choice(["unknown field", "blank line", "torn last line", "NaN loss", "optional field gone"])
            lines = [json.dumps(r) for r in recs]
            if what == "unknown field":  # written by a newer hf_cp
                lines[k] = json.dumps(dict(recs[k], new_metric=1.0))
            elif what == "blank line":
                lines.insert(k + 1, "")
            elif what == "torn last line":
                lines[-1] = lines[-1][: rng.randrange(1, len(lines[-1]) - 1)]
            elif what == "NaN loss":
                lines[k] = json.dumps(dict(recs[k], loss=math.nan))
            else:
                lines[k] = json.dumps({key: v for key, v in recs[k].items() if key != "compare_balancer"})
            case = Case(f"valid: {what}", False, (str(f),))
        lines = lines if lines is not None else [json.dumps(r) for r in recs]
        torn = case.what == "valid: torn last line"
        f.write_text("\n".join(lines) + ("" if torn else "\n"))
        yield case, run


def _histories(n: int, tmp: Path, report_every: int = 8) -> Tally:
    import warnings

    tally = Tally("history files")
    rng = random.Random(SEED)
    for i, (case, run) in enumerate(history_inputs(rng, tmp, n)):

        def read(run=run, i=i):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the torn last line's warning
                latest_records(run / "cp_history" / "rank0.jsonl")
                audit_samples(run)
                if i % report_every == 0:
                    _cli(["report", run, "--out", run / "report"])

        tally.judge(case, read, (HistoryError, RunLogError))
    return tally


def test_fuzz_history_files(tmp_path):
    _histories(FAST, tmp_path).check()


# ------------------------------------------------------------------ (f) plan JSON
@pytest.fixture(scope="module")
def plans_json(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("plans")
    lengths = tmp / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 40, 900, 120, 60, 700, 80, 200, 500, 90]))
    out = tmp / "plans.json"
    common = ["--model", "tiny-llama", "--profile", "cpu", "--max-tokens-per-rank", "512", "--steps", "3"]
    _cli(["plan", "--lengths", lengths, "--world", "4", *common, "--tokens-per-rank-per-step", "400", "--json", out])
    return out


PLAN_TOP_EDITS = [
    # (field, invalid values, valid values)
    ("world_size", [0, -4, 2.5, "4", None, True], [8]),
    ("max_tokens_per_rank", [0, 1, -1, "x", 512.5], [4096]),
    ("format", ["hf_cp.step_plan/0", None, 1], []),
    ("step", ["x", 1.5, None], [7]),
    ("balancer", [5, ["a"]], ["mine"]),
    ("notes", ["x", [1]], [["a note"]]),
    ("samples", ["x", [[1]], [], None, {"0": 1}], []),
    ("waves", ["x", [1], None], []),
    ("masks", [{"0": {"kind": "nope"}}, {"999": {"kind": "causal", "length": 3}}, "x", [1]], [None]),
]


# (what, world / text / dir, payload, invalid, the name a refusal gives): every fast run's last inputs
EXTREME_PLANS = [
    ("world_size = 1048576 in every plan (a hang)", "world", 1048576, True, "1048576"),
    ("world_size = 10**20 in every plan", "world", 10**20, True, "world_size"),
    ("100,000 nested lists", "text", lambda t: DEEP_JSON, True, "nested deeper"),
    ("a directory", "dir", None, True, "is a directory"),
]


def plan_inputs(rng: random.Random, good: Path, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    base = json.loads(good.read_text())
    ops = ["top", "top", "sample", "group", "delete", "file"]
    for i in range(n):
        d = json.loads(json.dumps(base))
        f = tmp / f"plans{i}.json"
        j = rng.randrange(len(d["plans"]))
        plan = d["plans"][j]
        op = ops[i % len(ops)]
        text = None
        if op == "top":
            key, bad, good_values = rng.choice(PLAN_TOP_EDITS)
            invalid = not good_values or rng.random() < 0.7
            v = rng.choice(bad if invalid else good_values)
            if key == "world_size" and not invalid:
                for p in d["plans"]:
                    p["world_size"] = v  # one cluster simulates them all
            plan[key] = v
            case = Case(f"plans[{j}].{key} = {v!r}", invalid, (str(f), key))
        elif op == "sample":
            s = rng.randrange(len(plan["samples"]))
            what = rng.choice(["length", "id"])
            if what == "length":
                v = rng.choice([0, -5, 2.5, "x", None, True])
                plan["samples"][s][1] = v
            elif len(plan["samples"]) > 1:
                v = plan["samples"][(s + 1) % len(plan["samples"])][0]  # another sample's id: a duplicate
                plan["samples"][s][0] = v
            else:
                v = "x"
                plan["samples"][s][0] = v
            case = Case(f"plans[{j}].samples[{s}] {what} = {v!r}", True, (str(f), "sample", "samples"))
        elif op == "group":
            w = rng.randrange(len(plan["waves"]))
            g = plan["waves"][w]["groups"][rng.randrange(len(plan["waves"][w]["groups"]))]
            what = rng.choice(["rank outside", "ranks text", "local list", "local key", "mode", "unknown sample"])
            if what == "rank outside":
                g["ranks"][0] = plan["world_size"]
            elif what == "ranks text":
                g["ranks"] = "0,1"
            elif what == "local list":
                g["local"] = [1]
            elif what == "local key":
                g["local"] = {"x": [1]}
            elif what == "mode":
                g["mode"] = "nope"
                g.setdefault("distributed", [plan["samples"][0][0]])
            else:
                g.setdefault("distributed", []).append(999)
                g.setdefault("mode", "ring_per_doc")
            case = Case(f"plans[{j}] wave {w} group: {what}", True, (str(f), "rank", "local", "mode", "sample"))
        elif op == "delete":
            key = rng.choice(["samples", "waves", "world_size", "max_tokens_per_rank", "format", "balancer", "step"])
            del plan[key]
            case = Case(f"plans[{j}] without {key}", key not in ("balancer", "step"), (str(f), key))
        else:
            text = rng.choice(["{not json", "[]", '{"plans": []}', '{"plans": "x"}', "5", "null", "", "\x00\xff"])
            case = Case(f"whole file {text!r}", True, (str(f),))
        if text is not None:
            f.write_bytes(text.encode("latin-1"))
        else:
            f.write_text(json.dumps(d))
        yield case, f
    for k, (what, kind, payload, invalid, name) in enumerate(EXTREME_PLANS):
        f = tmp / f"plans-extreme{k}.json"
        d = json.loads(json.dumps(base))
        if kind == "world":  # every plan: one cluster simulates them all
            for p in d["plans"]:
                p["world_size"] = payload
            kind, payload = "text", lambda t, d=d: json.dumps(d)
        _extreme_file(f, kind, payload, d, good.read_text())
        yield Case(what, invalid, (str(f), name)), f


def _plans(n: int, good: Path, tmp: Path) -> Tally:
    tally = Tally("plan JSON")
    rng = random.Random(SEED)
    for case, f in plan_inputs(rng, good, tmp, n):

        def load(f=f):
            StepPlan.load_file(f)  # what hf-cp replay reads
            _cli(["plan", "--plan-json", f, "--model", "tiny-llama", "--profile", "cpu"])

        tally.judge(case, load, (PlanError, MaskError))
    return tally


def test_fuzz_plan_json(plans_json, tmp_path):
    _plans(FAST, plans_json, tmp_path).check()


# ------------------------------------------------------------------ (g) DeepSpeed JSON
DS_RECIPE = ROOT / "recipes" / "ds-zero2-cpu.json"
DS_WORLD = 2  # the dry run's --world: train_batch_size = 2 ranks x 1 micro-batch x 1 step


def deepspeed_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    """The main job's DeepSpeed JSON, one key changed; valid by the config's own values (the
    tiny config: micro-batch 1, no accumulation, lr 3e-3, clipping 1.0, fp32)."""
    base = json.loads(DS_RECIPE.read_text())
    edits = [
        ("train_micro_batch_size_per_gpu", lambda: rng.choice([1, 2, 4, "auto"]), lambda v: v in (1, "auto")),
        ("gradient_accumulation_steps", lambda: rng.choice([1, 3, "auto"]), lambda v: v in (1, "auto")),
        ("train_batch_size", lambda: rng.choice([1, 2, 4, 7, "auto"]), lambda v: v in (DS_WORLD, "auto")),
        ("gradient_clipping", lambda: rng.choice([1.0, 0.3, "auto"]), lambda v: v in (1.0, "auto")),
        ("optimizer.params.lr", lambda: rng.choice([3e-3, 0.5, "auto"]), lambda v: v in (3e-3, "auto")),
        ("zero_optimization.stage", lambda: rng.choice([0, 1, 2, 3, 4, 7, -1]), lambda v: v in (0, 1, 2, 3)),
        ("bf16.enabled", lambda: rng.choice([True, False, "auto"]), lambda v: v in (False, "auto")),
        ("zero_optimization." + rng.choice(["bogus", "stagee", "overlap"]), lambda: 1, lambda v: False),
        (
            "zero_optimization.offload_optimizer",
            lambda: {"device": "nvme", "nvme_path": str(tmp / "none")},
            lambda v: False,
        ),
        (rng.choice(["zero_optimizationx", "steps_per_prnt"]), lambda: {}, lambda v: True),  # ignored: a warning
    ]
    for i in range(n):
        key, value, ok = edits[i % len(edits)]
        cfg = json.loads(json.dumps(base))
        v = value()
        node = cfg
        *head, last = key.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
        path = tmp / f"ds{i}.json"
        path.write_text(json.dumps(cfg))
        yield Case(f"deepspeed {key} = {v!r}", not ok(v), (str(path), last, key.split(".")[0])), path


def _deepspeed(n: int, tmp: Path) -> Tally:
    from hf_cp.train.checks.launch import check_launch_settings
    from hf_cp.train.checks.setup import SetupError
    from hf_cp.train.setup.config import load_config, training_arguments

    tally = Tally("DeepSpeed JSON")
    rng = random.Random(SEED)
    tcfg = load_config(str(TINY))["training"]
    for case, path in deepspeed_inputs(rng, tmp, n):

        def check(path=path):  # what CPTrainer and the dry run call, at the dry run's world size
            args = training_arguments(dict(tcfg, deepspeed=str(path), output_dir=str(tmp / "out")), str(TINY))
            check_launch_settings(args, DS_WORLD, str(path))

        tally.judge(case, check, (SetupError,))
    return tally


def test_fuzz_deepspeed_json(tmp_path):
    _deepspeed(FAST, tmp_path).check()


# slow: a 2-process launch each (~15-20 s on 2 cores): what the launch checks accept must train
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_deepspeed_json_accepted_by_the_dry_run_trains(tmp_path):
    """A launch sample of the DeepSpeed class: every distinct accepted input (by the key it
    changes: ZeRO stages 0, 1 and 3, an ignored key, ...) trains one step under `hf-cp train
    --nproc 2`, whose own pre-launch check is the dry run (before: ZeRO-3 failed at launch with
    DeepSpeed's 'Check batch related parameters' under torchrun)."""

    accepted, seen = [], set()
    for case, path in deepspeed_inputs(random.Random(SEED), tmp_path, 80):
        kind = (case.what.split(" = ")[0], case.what.split(" = ")[1] if "stage" in case.what else "")
        if not case.invalid and kind not in seen and "'auto'" not in case.what:
            seen.add(kind)
            accepted.append((case, path))
    assert len(accepted) >= 4, [c.what for c, _ in accepted]
    failed = [
        e for case, path in accepted if (e := _launch_one_step(case, TINY, tmp_path / path.stem, f"deepspeed={path}"))
    ]
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------ (h) token data
VOCAB = 256  # the tiny llama's


def token_inputs(rng: random.Random, n: int) -> Iterator[Tuple[Case, list]]:
    from helpers.harness.models import synthetic_rows

    ops = ["id", "id", "label", "label", "float", "empty", "length", "no-loss"]
    for i in range(n):
        rows = synthetic_rows([40, 30, 50, 20], seed=i)
        r = rng.randrange(len(rows))
        op = ops[i % len(ops)]
        column = "labels" if op in ("label", "no-loss") else "input_ids"
        if op in ("id", "label"):
            v = rng.choice([-1, 0, VOCAB - 1, VOCAB, 1000, -100])
            rows[r][column] = list(rows[r][column])
            rows[r][column][rng.randrange(len(rows[r][column]))] = v
            valid = 0 <= v < VOCAB or (column == "labels" and v == -100)
            case = Case(f"row {r} {column}: an id {v}", not valid, (f"row {r}", column))
        elif op == "float":
            rows[r]["input_ids"] = [float(t) + 0.5 for t in rows[r]["input_ids"]]
            case = Case(f"row {r} input_ids as floats", True, (f"row {r}", "input_ids"))
        elif op == "empty":
            rows[r]["input_ids"], rows[r]["labels"] = [], []
            case = Case(f"row {r} without tokens", True, (f"sample {r}", "input_ids"))
        elif op == "length":
            rows[r]["labels"] = rows[r]["labels"][:-1]
            case = Case(f"row {r} labels one short", True, (f"sample {r}", "labels"))
        else:
            for row in rows:
                row["labels"] = [-100] * len(row["input_ids"])
            case = Case("every label -100", True, ("train_dataset", "loss"))
        yield case, rows


def _tokens(n: int) -> Tally:
    from datasets import Dataset

    from hf_cp.train.data.columns import read_token_columns

    tally = Tally("token data")
    rng = random.Random(SEED)
    for case, rows in token_inputs(rng, n):
        tally.judge(
            case, lambda rows=rows: read_token_columns(Dataset.from_list(rows), vocab_size=VOCAB), (ValueError,)
        )
    return tally


def test_fuzz_token_data():
    _tokens(FAST).check()


# ------------------------------------------------------------------ (i) preference records
def preference_inputs(rng: random.Random, n: int) -> Iterator[Tuple[Case, list]]:
    empties = ["", "   ", "\n"]
    for i in range(n):
        rows = [{"prompt": f"question {k}", "chosen": f"good {k}", "rejected": f"bad {k}"} for k in range(4)]
        r, column = rng.randrange(4), rng.choice(["prompt", "chosen", "rejected"])
        kind = i % 4
        if kind == 0:
            rows[r][column] = rng.choice(empties)
            case = Case(f"pair {r} {column} {rows[r][column]!r}", True, (f"pair {r}", column))
        elif kind == 1:  # conversational, an empty turn
            rows = [
                {
                    "prompt": [{"role": "user", "content": x["prompt"]}],
                    "chosen": [{"role": "assistant", "content": x["chosen"]}],
                    "rejected": [{"role": "assistant", "content": x["rejected"]}],
                }
                for x in rows
            ]
            rows[r][column][0]["content"] = rng.choice(empties)
            case = Case(f"pair {r} {column} turn {rows[r][column][0]['content']!r}", True, (f"pair {r}", column))
        elif kind == 2:
            rows[r][column] = rows[r][column] + " " + "".join(rng.choice(string.ascii_letters) for _ in range(5))
            case = Case(f"pair {r} {column} longer", False, ("pair",))
        else:
            rows[r][column] = "0"  # text that is falsy only as a number
            case = Case(f"pair {r} {column} '0'", False, ("pair",))
        yield case, rows


def _preferences(n: int) -> Tally:
    from datasets import Dataset

    from hf_cp.train.checks.answers import refuse_empty_answers

    tally = Tally("preference records")
    rng = random.Random(SEED)
    for case, rows in preference_inputs(rng, n):
        tally.judge(case, lambda rows=rows: refuse_empty_answers(Dataset.from_list(rows), "train"), (ValueError,))
    return tally


def test_fuzz_preference_records():
    _preferences(FAST).check()


# ------------------------------------------------------------------ (j) lengths files and (k) CLI flags
PLAN_LENGTHS = [300, 40, 900, 120, 60, 700, 80, 200]
PLAN_FLAGS = {  # flag: (valid values, invalid values), around the plan below
    "--world": ([1, 2, 3, 4, 8], [0, -2, 65537, 1048576, "x", 2.5]),
    "--max-tokens-per-rank": ([512, 1024, 10**6], [0, -3, "abc", 1.5, 10**17]),
    "--gpus-per-node": ([1, 2, 8], [0, -1, 5000, "y"]),
    "--device-memory-gb": ([0, 80, 141], [-5, "nan", "inf", 1e12]),
    "--steps": ([1, 2], [0, -1, "z"]),
    "--tokens-per-rank-per-step": ([400, 4096], [0, -400, "q"]),
}


def _plan_cli(args: Sequence[str]) -> None:
    """hf-cp plan in this process: a non-zero exit, argparse's own included, raises Refused."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse: "argument --world: invalid int value: 'x'"
            rc = e.code if isinstance(e.code, int) else 2
    if rc != 0:
        raise Refused(err.getvalue() or f"exit {rc}")


def _plan_args(lengths: Path, **flags) -> List[str]:
    base = {"--world": 4, "--max-tokens-per-rank": 512, "--tokens-per-rank-per-step": 400, "--steps": 1}
    base.update(flags)
    out = ["plan", "--lengths", str(lengths), "--model", "tiny-llama", "--profile", "cpu"]
    for k, v in base.items():
        out += [k, str(v)]
    return out


def lengths_inputs(rng: random.Random, tmp: Path, n: int) -> Iterator[Tuple[Case, Path]]:
    """A lengths file (one token count a line), one line changed or the file emptied."""
    bad = ["0", "-7", "3.5", "abc", "1e3", str(2**60), "", "  ", "nan", "12 13"]
    for i in range(n):
        lines = [str(x) for x in PLAN_LENGTHS]
        k = rng.randrange(len(lines))
        path = tmp / f"lengths{i}.txt"
        if i % 4 == 3:  # a valid change: another positive count
            lines[k] = str(rng.randrange(1, 2000))
            case = Case(f"line {k + 1} = {lines[k]}", False, (str(path),))
        elif i % 8 == 6:
            lines = []
            case = Case("an empty file", True, (str(path), "lengths"))
        else:
            lines[k] = rng.choice(bad)
            # a blank line is skipped; "1e3" is not a whole number as written
            case = Case(f"line {k + 1} = {lines[k]!r}", bool(lines[k].strip()), (str(path), f"line {k + 1}"))
        path.write_text("\n".join(lines) + ("\n" if lines else ""))
        yield case, path


def _lengths(n: int, tmp: Path) -> Tally:
    tally = Tally("lengths files")
    for case, path in lengths_inputs(random.Random(SEED), tmp, n):
        tally.judge(case, lambda path=path: _plan_cli(_plan_args(path)), ())
    return tally


def test_fuzz_lengths_files(tmp_path):
    _lengths(FAST, tmp_path).check()


def flag_inputs(rng: random.Random, n: int) -> Iterator[Tuple[Case, dict]]:
    flags = sorted(PLAN_FLAGS)
    for i in range(n):
        flag = flags[i % len(flags)]
        good, bad = PLAN_FLAGS[flag]
        invalid = i % 3 != 0
        value = rng.choice(bad if invalid else good)
        yield Case(f"{flag} {value}", invalid, (flag,)), {flag: value}


def _flags(n: int, tmp: Path) -> Tally:
    tally = Tally("CLI flags")
    lengths = tmp / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in PLAN_LENGTHS) + "\n")
    for case, flags in flag_inputs(random.Random(SEED), n):
        tally.judge(case, lambda flags=flags: _plan_cli(_plan_args(lengths, **flags)), ())
    return tally


def test_fuzz_cli_flags(tmp_path):
    _flags(FAST, tmp_path).check()


# ------------------------------------------------------------------ the bigger sweep
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "kind",
    [
        "profiles",
        "groups",
        "configs",
        "checkpoints",
        "histories",
        "plans",
        "deepspeed",
        "tokens",
        "preferences",
        "lengths",
        "flags",
    ],
)
def test_fuzz_sweep(kind, request, tmp_path):
    if kind == "deepspeed":
        tally = _deepspeed(SLOW // 2, tmp_path)
    elif kind == "lengths":
        tally = _lengths(SLOW, tmp_path)
    elif kind == "flags":
        tally = _flags(SLOW // 2, tmp_path)
    elif kind == "tokens":
        tally = _tokens(SLOW)
    elif kind == "preferences":
        tally = _preferences(SLOW)
    elif kind == "profiles":
        tally = _profiles(SLOW, tmp_path)
    elif kind == "groups":
        tally = _groups(SLOW // 2, tmp_path)
    elif kind == "configs":
        tally = _configs(SLOW // 2, tmp_path)
    elif kind == "checkpoints":
        tally = _checkpoints(SLOW, request.getfixturevalue("saved_run"), tmp_path)
    elif kind == "histories":
        tally = _histories(SLOW, tmp_path, report_every=10)
    else:
        tally = _plans(SLOW, request.getfixturevalue("plans_json"), tmp_path)
    tally.check()
