"""Tokenise one batch of samples and build SFT labels.

Text samples: the tokenizer's own special tokens plus an end-of-sequence token; every token is
trained. Prompt-completion samples (TRL's format: `prompt` and `completion`, strings or lists of
messages) are tokenised exactly as TRL's SFTTrainer does, the completion alone trained. Chat samples (a list of {role, content} messages): rendered with the tokenizer's chat
template and tokenised without adding special tokens again (the template already has them),
so `decode(input_ids)` is exactly the rendered text. Labels are -100 outside the trained
spans: with mask "assistant", every assistant turn (its content and the template's
end-of-turn marker) is trained; with "last-assistant", only the final one.

An assistant turn's characters are found by rendering the conversation prefixes: the turn is
what `render(messages[:i+1])` adds to `render(messages[:i], add_generation_prompt=True)`. That
needs no generation markers in the template, only that rendering is prefix-stable (earlier
turns render the same whatever follows), which is checked per sample.
"""

from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

IGNORE_INDEX = -100
CHAT_MASKS = ("assistant", "last-assistant", "none")
TEXT_MASKS = ("none",)
PROMPT_COMPLETION_MASKS = ("completion", "none")
KINDS = ("text", "chat", "prompt-completion")


class EncodeError(ValueError):
    """A sample cannot be encoded; the message names the sample index and field."""


# the roles of OpenAI-style chat data that the families' chat templates render
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(value, index: int, field: str) -> List[dict]:
    if isinstance(value, str):  # CSV and some JSON exports store the list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise EncodeError(f"sample {index}: field {field!r} is a string but not JSON: {e}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise EncodeError(f"sample {index}: field {field!r} must be a non-empty list of messages, got {value!r:.80}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EncodeError(f"sample {index}: {field}[{k}] must have 'role' and 'content', got {m!r:.80}")
        if m["content"] is None or m["role"] is None:
            raise EncodeError(f"sample {index}: {field}[{k}] has an empty role or content")
        if m["role"] not in CHAT_ROLES:
            raise EncodeError(
                f"sample {index}: {field}[{k}] has role {m['role']!r}; chat templates know {', '.join(CHAT_ROLES)} "
                f"(another role is rendered as nothing, or as the template's fallback, silently)"
            )
        if isinstance(m["content"], str) and not m["content"].strip():
            raise EncodeError(
                f"sample {index}: {field}[{k}] ({m['role']}) has empty content: drop the turn or the sample"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


class SampleEncoder:
    """Picklable batched map function: raw columns -> input_ids, labels, length."""

    def __init__(
        self,
        tokenizer,
        kind: str,
        field: str,
        mask: str = "auto",
        add_eos: bool = True,
        completion_field: str = "completion",
    ):
        if kind not in KINDS:
            raise ValueError(f"sample kind must be one of {', '.join(KINDS)}, got {kind!r}")
        default = {"chat": "assistant", "prompt-completion": "completion", "text": "none"}[kind]
        mask = default if mask == "auto" else mask
        allowed = {"chat": CHAT_MASKS, "prompt-completion": PROMPT_COMPLETION_MASKS, "text": TEXT_MASKS}[kind]
        if mask not in allowed:
            raise ValueError(f"--mask {mask!r} does not apply to {kind} samples; choose from {', '.join(allowed)}")
        self.completion_field = completion_field
        if kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                f"chat samples need one (or use --text-field for plain text)"
            )
        if kind == "chat" and mask != "none" and not getattr(tokenizer, "is_fast", False):
            raise ValueError("label masking of chat samples needs a fast tokenizer (character offsets)")
        self.tokenizer, self.kind, self.field, self.mask, self.add_eos = tokenizer, kind, field, mask, add_eos

    # ---------------------------------------------------------------- chat
    def _render(self, messages: Sequence[dict], index: int, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja's TemplateError and raise_exception() in templates
            raise EncodeError(f"sample {index}: the chat template failed: {type(e).__name__}: {e}") from None

    def _assistant_spans(self, messages: List[dict], full: str, index: int) -> List[Tuple[int, int]]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.mask == "last-assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            if i == 0:
                raise EncodeError(f"sample {index}: message 0 is an assistant turn; a prompt must come first")
            before = self._render(messages[:i], index, generation_prompt=True)
            upto = self._render(messages[: i + 1], index)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise EncodeError(
                    f"sample {index}: the chat template does not render conversation prefixes as prefixes of the "
                    f"whole (at message {i}), so assistant turns cannot be located; use --mask none"
                )
            spans.append((len(before), len(upto)))
        return spans

    def _encode_chat(self, value, index: int) -> Tuple[List[int], List[int]]:
        messages = _messages(value, index, self.field)
        full = self._render(messages, index)
        spans = self._assistant_spans(messages, full, index) if self.mask != "none" else []
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=self.mask != "none")
        ids = list(enc["input_ids"])
        if self.mask == "none":
            return ids, list(ids)
        labels = [IGNORE_INDEX] * len(ids)
        k = 0
        for j, (start, _end) in enumerate(enc["offset_mapping"]):
            # a token belongs to the turn its first character is in (offsets are sorted)
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                labels[j] = ids[j]
        return ids, labels

    # ---------------------------------------------------------------- prompt-completion
    def _encode_prompt_completion(self, prompt, completion, index: int) -> Tuple[List[int], List[int], bool]:
        """TRL's SFTTrainer tokenisation of one prompt-completion sample, so that data prepared here
        and data TRL prepares train the same tokens: a text prompt and completion are tokenised as
        `prompt` and `prompt + completion` (the completion ending in the EOS token), a conversational
        one (lists of messages) rendered as prompt + generation prompt and as prompt + completion.
        The completion starts where the two token sequences diverge; it alone is trained (mask
        'completion'). Returns (input_ids, labels, whether the prompt's tokens were not a prefix)."""
        if isinstance(prompt, (list, tuple)):  # conversational, as TRL tells it: a list of messages
            p_msgs = _messages(prompt, index, self.field)
            c_msgs = _messages(completion, index, self.completion_field)
            if not getattr(self.tokenizer, "chat_template", None):
                raise EncodeError(
                    f"sample {index}: conversational prompt/completion needs a tokenizer with a chat template"
                )
            prompt_text = self._render(p_msgs, index, generation_prompt=True)
            full_text = self._render(p_msgs + c_msgs, index)
            prompt_ids = list(self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            ids = list(self.tokenizer(full_text, add_special_tokens=False)["input_ids"])
        else:
            for name, value in ((self.field, prompt), (self.completion_field, completion)):
                if not isinstance(value, str):
                    raise EncodeError(f"sample {index}: field {name!r} must be a string, got {type(value).__name__}")
            eos = self.tokenizer.eos_token
            if self.add_eos and eos is not None and not completion.endswith(eos):
                completion = completion + eos
            prompt_ids = list(self.tokenizer(prompt)["input_ids"])
            ids = list(self.tokenizer(prompt + completion)["input_ids"])
        k = 0
        while k < min(len(prompt_ids), len(ids)) and prompt_ids[k] == ids[k]:
            k += 1
        labels = list(ids) if self.mask == "none" else [IGNORE_INDEX] * k + ids[k:]
        return ids, labels, k < len(prompt_ids)

    # ---------------------------------------------------------------- text
    def _encode_texts(self, texts: Sequence, indices: Sequence[int]) -> List[List[int]]:
        for t, i in zip(texts, indices):
            if not isinstance(t, str):
                raise EncodeError(f"sample {i}: field {self.field!r} must be a string, got {type(t).__name__}")
        batch = self.tokenizer(list(texts))["input_ids"]
        eos = self.tokenizer.eos_token_id
        out = []
        for ids in batch:
            ids = list(ids)
            if self.add_eos and eos is not None and ids and ids[-1] != eos:
                ids.append(eos)
            out.append(ids)
        return out

    def __call__(self, batch: Dict[str, list], indices: Sequence[int]) -> Dict[str, list]:
        if self.field not in batch:
            raise EncodeError(f"samples have no field {self.field!r} (fields: {sorted(batch)})")
        values = batch[self.field]
        extra = {}  # columns only one kind of sample has
        if self.kind == "text":
            all_ids = self._encode_texts(values, indices)
            all_labels = [list(x) for x in all_ids]
        elif self.kind == "prompt-completion":
            if self.completion_field not in batch:
                raise EncodeError(f"samples have no field {self.completion_field!r} (fields: {sorted(batch)})")
            triples = [
                self._encode_prompt_completion(p, c, i)
                for p, c, i in zip(values, batch[self.completion_field], indices)
            ]
            all_ids = [t[0] for t in triples]
            all_labels = [t[1] for t in triples]
            extra = {"prompt_not_prefix": [t[2] for t in triples]}
        else:
            pairs = [self._encode_chat(v, i) for v, i in zip(values, indices)]
            all_ids = [p[0] for p in pairs]
            all_labels = [p[1] for p in pairs]
        return {
            "input_ids": all_ids,
            "labels": all_labels,
            "length": [len(x) for x in all_ids],
            "trained_tokens": [trained_tokens(y) for y in all_labels],
            **extra,
        }


def trained_tokens(labels: Sequence[int]) -> int:
    """Tokens that contribute to the loss (the collator predicts token p from p-1, so label 0
    is never a target)."""
    return sum(1 for y in labels[1:] if y != IGNORE_INDEX)


def truncate(row: Dict, max_length: int) -> Dict:
    labels = row["labels"][:max_length]
    return {
        "input_ids": row["input_ids"][:max_length],
        "labels": labels,
        "length": min(row["length"], max_length),
        "trained_tokens": trained_tokens(labels),
    }
