"""How a training config's errors name the file and the key, and where its paths are looked for:
shared by the config's sections (setup/config.py, setup/model_section.py)."""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator, Optional

from hf_cp.resources import input_path
from hf_cp.train.setup.schema import TrainConfigError

LOOKED = "looked in the working directory, then among the files hf_cp ships"


def resolve_input(p: str) -> str:
    """A path named in a config: in the working directory, else among the files hf_cp ships."""
    return str(input_path(p))


def key_named(message: str, keys: Iterable[str], preferred: Iterable[str] = ()) -> Optional[str]:
    """The first of `keys` the message names as a word (a key the config set first, the longest
    at a position: cp_max_tokens_per_rank, not max_tokens_per_rank)."""
    for candidates in (list(preferred), list(keys)):
        found = [
            (m.start(), -len(k), k)
            for k in candidates
            for m in [re.search(rf"(?<![A-Za-z0-9_]){re.escape(k)}(?![A-Za-z0-9_])", message)]
            if m
        ]
        if found:
            return min(found)[2]
    return None


@contextlib.contextmanager
def named_errors(source: str, section: str, keys: Iterable[str], preferred: Iterable[str] = ()) -> Iterator[None]:
    """Errors raised inside (building CPTrainingArguments, the model config, a name's file) come
    out as the same exception type with the config file and `section.key` before the message, the
    key being the first of `keys` the message names (`section` alone when it names none; a
    `section` such as "training.cp_profile" names the key itself); the message itself is kept."""
    try:
        yield
    except (ValueError, KeyError, TypeError, ArithmeticError) as e:
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if text.startswith(f"{source}: "):  # already named (a TrainConfigError of the schema)
            raise
        key = key_named(text, keys, preferred)
        where = f"{section}.{key}" if key else section
        message = f"{source}: {where}: {text}"
        if isinstance(e, ArithmeticError):  # a division by a zero the file gave (a user error, not a crash)
            raise TrainConfigError(f"{message} ({type(e).__name__}: a count in it is zero or out of range)") from None
        try:
            error = type(e)(message)
        except Exception:  # noqa: BLE001 (an exception type that takes other arguments)
            error = TrainConfigError(message)
        raise error from None
