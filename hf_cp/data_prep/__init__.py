"""Turn a dataset of text or chat samples into what CPTrainer and `hf-cp plan` read.

Output rows: `input_ids`, `labels` (aligned with input_ids, -100 where no loss is taken; the
trainer's collator shifts them inside each document) and `length` (= len(input_ids)).
"""

from hf_cp.data_prep.encode import EncodeError, SampleEncoder
from hf_cp.data_prep.inputs import InputError, load_input
from hf_cp.data_prep.length_report import LengthReport, length_report
from hf_cp.data_prep.pipeline import OVERLONG_POLICIES, PreprocessResult, preprocess
from hf_cp.data_prep.tokenizer import load_tokenizer

__all__ = [
    "EncodeError",
    "InputError",
    "LengthReport",
    "OVERLONG_POLICIES",
    "PreprocessResult",
    "SampleEncoder",
    "length_report",
    "load_input",
    "load_tokenizer",
    "preprocess",
]
