"""A `data_collator` handed to CPTrainer: accepted when hf_cp already does what it does, refused
by name otherwise.

CPTrainer never calls a data collator: each rank's micro-batches come from the step's plan
(collator.PlanCollator), packed without padding, position ids restarting per document,
documents never attending to each other, targets from the `labels` column (else every next
token). A collator that only pads, flattens or copies labels is therefore reproduced, and the
user is told so once. One that changes what is trained (masked-LM corruption, labels rebuilt
from input_ids over a labels column, shifted position ids, custom code) cannot be, and is
refused with what to do instead: a silent no-op would train something else than the user asked.
"""

from __future__ import annotations

import inspect
from typing import Optional

# (module prefix, name) of collators whose whole effect hf_cp reproduces
PADDING_ONLY = {
    ("transformers", "default_data_collator"),
    ("transformers", "DefaultDataCollator"),
    ("transformers", "DataCollatorWithPadding"),
    ("transformers", "DataCollatorForSeq2Seq"),
}

WHAT_HF_CP_DOES = (
    "hf_cp builds each rank's micro-batches from the step's plan itself: documents packed without padding, "
    "position ids restarting per document, no attention across documents, targets from the labels column "
    "(-100 = no loss; without that column every next token)"
)


class UnsupportedCollatorError(TypeError):
    """A data_collator whose effect hf_cp cannot reproduce; the message names it and the way out."""


def _identity(collator) -> tuple:
    """(top-level package, qualified name, module) of a collator object, class or function."""
    kind = collator if inspect.isfunction(collator) or isinstance(collator, type) else type(collator)
    module = getattr(kind, "__module__", "") or ""
    return module.split(".")[0], getattr(kind, "__qualname__", kind.__name__), module


def collator_name(collator) -> str:
    top, name, module = _identity(collator)
    return f"{module}.{name}" if module else name


def check_data_collator(collator, has_labels: bool) -> Optional[str]:
    """None when `collator` is None; a note for the log when hf_cp reproduces its effect;
    raises UnsupportedCollatorError otherwise. `has_labels`: the training data has a labels column."""
    if collator is None:
        return None
    top, name, module = _identity(collator)
    full = collator_name(collator)
    refuse = (
        f"data_collator {full} is not used by CPTrainer: {WHAT_HF_CP_DOES}. "
        "What this collator would change cannot be reproduced there"
    )
    if (top, name) in PADDING_ONLY:
        return f"data_collator {full} is not called: it pads batches, and {WHAT_HF_CP_DOES}; nothing changes"
    if (top, name) == ("transformers", "DataCollatorWithFlattening"):
        start = getattr(collator, "position_ids_start", 0)
        if start != 0:
            raise UnsupportedCollatorError(
                f"{refuse}: it numbers positions from {start}, hf_cp from 0. Models that need another start "
                "(RoBERTa-like absolute positions) are not supported"
            )
        return f"data_collator {full} is not called: it flattens a batch into one packed row, and {WHAT_HF_CP_DOES}"
    if (top, name) == ("transformers", "DataCollatorForLanguageModeling"):
        if getattr(collator, "mlm", True):
            raise UnsupportedCollatorError(
                f"{refuse}: masked language modelling (mlm=True) corrupts inputs at random; CPTrainer trains "
                "causal language models. Use DataCollatorForLanguageModeling(mlm=False) or no data_collator"
            )
        if has_labels:
            raise UnsupportedCollatorError(
                f"{refuse}: with mlm=False it trains every token, replacing the dataset's labels column, while "
                "hf_cp trains the labels column. Drop the labels column to train every token, or drop data_collator "
                "to train the labels as given"
            )
        return (
            f"data_collator {full}(mlm=False) is not called: it trains every next token (labels = input_ids), "
            f"as hf_cp does without a labels column; {WHAT_HF_CP_DOES}"
        )
    if (top, name) == ("trl", "DataCollatorForLanguageModeling"):
        # TRL (>= 1.x) builds the labels column when it prepares the dataset; its collator pads
        # (or flattens, padding_free) and copies those labels
        return f"data_collator {full} is not called: it pads or flattens rows and copies their labels, and {WHAT_HF_CP_DOES}"
    raise UnsupportedCollatorError(
        f"{refuse}. Apply what it does per sample to the dataset before training (datasets.map: input_ids, "
        "labels with -100 on untrained tokens), then pass no data_collator"
    )
