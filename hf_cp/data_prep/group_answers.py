"""`hf-cp preprocess --group-answers`: one prompt and its answers become one shared-prompt sample.

Input records (one per prompt):
    {"prompt": P, "answers": [a1, ..., an]}      n samples per prompt (GRPO / RLOO groups,
                                                 best-of-n); also under "responses" or
                                                 "completions"
    {"prompt": P, "chosen": c, "rejected": r}    preference pairs (TRL's DPO format)
    {"prompt": P, "completion": c}               one answer (a plain prompt-completion record)
P and the answers are either text, or conversations (TRL's conversational format: the prompt a
list of {role, content} messages, each answer a list of messages or one assistant message).

Output sample: [prompt][answer 1]...[answer n] with the mask
`SampleMask.shared_prompt(len(prompt), [len(a) for a in answers])` in the `attn_mask` column:
every answer sees the prompt and itself, its positions continue from the prompt's end, its
labels never cross into another answer, and the prompt's tokens are stored (and computed) once.
Training it equals training each (prompt, answer i) as its own sequence with the prompt's
targets counted once (hf_cp/sample_targets.py).

Tokens: text prompts are tokenised with the tokenizer's special tokens (a BOS, say), answers
without them plus an EOS token, each on its own (as preference trainers do), so answer i's
tokens are the same in every group it appears in. Conversations are rendered with the chat
template: the prompt with the generation prompt, each answer as what rendering prompt + answer
adds to it (checked to be a prefix, as hf-cp preprocess does for chat turns).

Labels: the prompt is masked (-100) and the answers are trained, except `rejected` answers of
preference pairs: hf_cp's loss is token cross-entropy, which would teach a rejected answer, so
they carry no labels unless `train_rejected` (they still shape the step's attention work).
mask "none" trains the prompt's tokens too (counted once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hf_cp.data_prep.encode import IGNORE_INDEX, EncodeError, truncate
from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.targets import sample_valid_targets

ANSWER_LIST_FIELDS = ("answers", "responses", "completions")
GROUP_MASKS = ("answers", "none")


@dataclass(frozen=True)
class GroupLayout:
    """Which columns hold the prompt and the answers of a record."""

    prompt: str
    answers: Tuple[str, ...]  # one list column, or single-answer columns in order
    as_list: bool  # answers[0] holds a list of answers
    untrained: Tuple[str, ...] = ()  # answer columns that carry no labels (rejected answers)

    def describe(self) -> str:
        what = f"{self.answers[0]!r} lists" if self.as_list else " + ".join(repr(a) for a in self.answers)
        return f"prompt {self.prompt!r}, answers {what}"


def group_layout(
    columns: Sequence[str], prompt_field: str = "prompt", answers_field: Optional[str] = None, train_rejected=False
) -> GroupLayout:
    """The layout of the input's records, from its columns; errors say which columns it needs."""
    cols = list(columns)
    if prompt_field not in cols:
        hint = (
            "; preference data without a prompt column (an implicit prompt inside chosen/rejected) needs "
            "trl.extract_prompt first"
            if "chosen" in cols
            else ""
        )
        raise EncodeError(
            f"--group-answers: no {prompt_field!r} column (columns: {cols}); name it with --prompt-field{hint}"
        )
    if answers_field:
        if answers_field not in cols:
            raise EncodeError(f"--answers-field {answers_field!r} is not a column of the input (columns: {cols})")
        return GroupLayout(prompt_field, (answers_field,), True)
    for f in ANSWER_LIST_FIELDS:
        if f in cols:
            return GroupLayout(prompt_field, (f,), True)
    if "chosen" in cols and "rejected" in cols:
        return GroupLayout(prompt_field, ("chosen", "rejected"), False, () if train_rejected else ("rejected",))
    if "completion" in cols:
        return GroupLayout(prompt_field, ("completion",), False)
    raise EncodeError(
        f"--group-answers: no answers in the input (columns: {cols}); expected a list column "
        f"{' / '.join(repr(f) for f in ANSWER_LIST_FIELDS)}, 'chosen' and 'rejected', or 'completion' "
        f"(or name it with --answers-field)"
    )


def _is_messages(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in value) and bool(value)


class GroupAnswersEncoder:
    """Picklable batched map function: records -> input_ids, labels, length, trained_tokens,
    attn_mask (the shared-prompt mask as JSON), answers (how many)."""

    def __init__(self, tokenizer, layout: GroupLayout, mask: str = "auto", add_eos: bool = True):
        mask = "answers" if mask == "auto" else mask
        if mask not in GROUP_MASKS:
            raise ValueError(
                f"--mask {mask!r} does not apply to --group-answers; choose from auto, {', '.join(GROUP_MASKS)}"
            )
        self.tokenizer, self.layout, self.mask, self.add_eos = tokenizer, layout, mask, add_eos

    # ---------------------------------------------------------------- one record
    def _answers(self, batch: Dict[str, list], j: int, index: int) -> List[Tuple[object, bool]]:
        """(answer, trained) pairs of record j."""
        lay = self.layout
        if lay.as_list:
            # fields are taken as the input format gives them: JSON is parsed per record by the
            # loader, never again inside a field, so text that looks like JSON stays text
            value = batch[lay.answers[0]][j]
            if not isinstance(value, (list, tuple)) or not value:
                hint = (
                    " (a text field is one answer, never parsed: give the answers as a list, in JSON lines or parquet)"
                    if isinstance(value, str)
                    else ""
                )
                raise EncodeError(
                    f"sample {index}: {lay.answers[0]!r} must be a non-empty list of answers, got {value!r:.80}{hint}"
                )
            if _is_messages(value):  # one conversation is one answer, not a list of answers
                value = [value]
            return [(a, True) for a in value]
        return [(batch[f][j], f not in lay.untrained) for f in lay.answers]

    def _render(self, messages, index: int, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja's TemplateError and raise_exception() in templates
            raise EncodeError(f"sample {index}: the chat template failed: {type(e).__name__}: {e}") from None

    def _ids(self, text: str, special: bool) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _encode_text(self, prompt, answers, index: int) -> Tuple[List[int], List[List[int]]]:
        eos = self.tokenizer.eos_token_id
        p = self._ids(prompt, True)
        out = []
        for k, a in enumerate(answers):
            if not isinstance(a, str):
                raise EncodeError(f"sample {index}: answer {k} must be text like the prompt, got {type(a).__name__}")
            ids = self._ids(a, False)
            if self.add_eos and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append(ids)
        return p, out

    def _encode_chat(self, prompt, answers, index: int) -> Tuple[List[int], List[List[int]]]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r} has no chat template; "
                f"conversational prompts need one"
            )
        bad = next((k for k, m in enumerate(prompt) if "content" not in m), None)
        if bad is not None:
            raise EncodeError(f"sample {index}: prompt message {bad} has no 'content' (a message is {{role, content}})")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        head = self._render(messages, index, generation_prompt=True)
        out = []
        for k, a in enumerate(answers):
            turn = a if _is_messages(a) else [a] if isinstance(a, dict) else [{"role": "assistant", "content": a}]
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in turn):
                raise EncodeError(f"sample {index}: answer {k} must be text, a message or a list of messages")
            full = self._render(messages + [{"role": m["role"], "content": m["content"]} for m in turn], index)
            if not full.startswith(head):
                raise EncodeError(
                    f"sample {index}: the chat template does not render the prompt as a prefix of prompt + answer {k}, "
                    f"so the answer's tokens cannot be separated from the prompt's"
                )
            out.append(self._ids(full[len(head) :], False))
        return self._ids(head, False), out

    def encode(self, batch: Dict[str, list], j: int, index: int) -> Dict[str, object]:
        prompt = batch[self.layout.prompt][j]
        answers = self._answers(batch, j, index)
        texts = [a for a, _ in answers]
        if _is_messages(prompt):
            p, ans = self._encode_chat(prompt, texts, index)
        elif isinstance(prompt, str):
            p, ans = self._encode_text(prompt, texts, index)
        else:
            raise EncodeError(
                f"sample {index}: prompt {self.layout.prompt!r} must be text or a list of messages, got {prompt!r:.80}"
            )
        empty = [k for k, a in enumerate(ans) if not a]
        if empty:
            raise EncodeError(f"sample {index}: answer {empty[0]} encodes to no tokens")
        ids = list(p) + [t for a in ans for t in a]
        labels = list(p) if self.mask == "none" else [IGNORE_INDEX] * len(p)
        for a, (_, trained) in zip(ans, answers):
            labels += list(a) if trained else [IGNORE_INDEX] * len(a)
        mask = SampleMask.shared_prompt(len(p), [len(a) for a in ans])
        return {
            "input_ids": ids,
            "labels": labels,
            "length": len(ids),
            "trained_tokens": sample_valid_targets(ids, labels, mask),
            MASK_COLUMN: encode_mask(mask),
            "answers": len(ans),
        }

    def __call__(self, batch: Dict[str, list], indices: Sequence[int]) -> Dict[str, list]:
        rows = [self.encode(batch, j, i) for j, i in enumerate(indices)]
        return {
            k: [r[k] for r in rows] for k in ("input_ids", "labels", "length", "trained_tokens", MASK_COLUMN, "answers")
        }


def truncate_group(row: Dict, max_length: int) -> Dict:
    """Fit a shared-prompt sample into `max_length` tokens: keep the prompt and the answers that
    fit whole, in order; if not even the first fits, cut it. A prompt of `max_length` tokens or
    more leaves no room for an answer: EncodeError (drop the sample or raise --max-length)."""
    if row[MASK_COLUMN] is None:  # one answer: a causal sample
        return dict(truncate(row, max_length), **{MASK_COLUMN: None, "answers": row["answers"]})
    mask = SampleMask.from_dict(json.loads(row[MASK_COLUMN]))
    p = mask.prompt
    if p >= max_length:
        raise EncodeError(
            f"a shared-prompt sample's prompt has {p} tokens, leaving no room for an answer within --max-length "
            f"{max_length}; choose --overlong drop or raise --max-length"
        )
    kept, total = [], p
    for a in mask.answers:
        if total + a > max_length:
            break
        kept.append(a)
        total += a
    if not kept:
        kept, total = [max_length - p], max_length
    new = SampleMask.shared_prompt(p, kept)
    ids, labels = row["input_ids"][:total], row["labels"][:total]
    return {
        "input_ids": ids,
        "labels": labels,
        "length": total,
        "trained_tokens": sample_valid_targets(ids, labels, new),
        MASK_COLUMN: encode_mask(new),
        "answers": len(kept),
    }
