"""Empty prompts and answers of preference data (DPO pairs, KTO examples), refused by name: by
CPDPOTrainer and CPKTOTrainer before TRL tokenises the rows, and by the dry run before any launch.
Torch- and TRL-free, so that the dry run reads it on a login node."""

from __future__ import annotations

from typing import Iterable

PAIR_COLUMNS = ("prompt", "chosen", "rejected")  # a DPO pair's text
EXAMPLE_COLUMNS = ("prompt", "completion", "chosen", "rejected")  # a KTO example's (or a pair TRL unpairs)
# trainer: -> (the trainer named in the error, the columns read, what a row is called)
EMPTY_ANSWER_CHECKS = {
    "dpo": ("CPDPOTrainer", PAIR_COLUMNS, "pair"),
    "kto": ("CPKTOTrainer", EXAMPLE_COLUMNS, "example"),
}


def _answer_text(value) -> str:
    """The text of an answer: a string, or a conversation's messages' content (TRL's
    conversational format: a list of {"role", "content"}, content a string or a list of parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        parts = []
        for m in value:
            content = m.get("content", "") if isinstance(m, dict) else m
            if isinstance(content, (list, tuple)):  # multimodal parts: {"type": "text", "text": ...}
                content = " ".join(str(c.get("text", "x")) if isinstance(c, dict) else str(c) for c in content)
            parts.append(str(content or ""))
        return "".join(parts)
    return "" if value is None else str(value)


def refuse_empty_answers(
    dataset,
    dataset_name: str,
    trainer: str = "CPDPOTrainer",
    columns: Iterable[str] = PAIR_COLUMNS,
    item: str = "pair",
) -> None:
    """Refuse an example whose prompt or answer text is empty, naming it: TRL tokenises an
    empty answer to the EOS token alone, which would train as if it were an answer."""
    cols = getattr(dataset, "column_names", None) or []
    for column in columns:
        if column not in cols:
            continue
        for i, value in enumerate(dataset[column]):
            if not _answer_text(value).strip():
                what = "text" if column == "prompt" else "answer"
                raise ValueError(
                    f"{trainer}: {dataset_name} {item} {i}: the {column} {what} is empty (TRL would tokenise it to the "
                    f"EOS token alone and train on it); drop or fix the {item}"
                )
