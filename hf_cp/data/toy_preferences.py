"""A toy preference task for the DPO recipe (recipes/trl_dpo.py): prompt/chosen/rejected text
pairs in TRL's format, generated deterministically, no download.

Each pair asks a question with one right short answer (arithmetic, a colour, an opposite); the
chosen answer is right, the rejected one wrong. One pair in `long_every` (4) carries a long
"read this first" context before its question (about 230 tokens a pair against 25): a step's
pairs are long-tailed, so that fixed-length packing leaves one rank idle where a balancer
does not, and with a cap under 230 tokens a rank (the recipe's 192) those pairs run over a CP
group. A model trained with DPO on
it learns to prefer the right answers: the loss falls from log 2 and the preference accuracy
(`rewards/accuracies`) rises.
"""

from __future__ import annotations

import random
from typing import Dict, List

_COLOURS = [("the sky on a clear day", "blue", "green"), ("grass", "green", "purple"), ("snow", "white", "black")]
_COLOURS += [("a ripe banana", "yellow", "blue"), ("coal", "black", "white"), ("a ripe tomato", "red", "blue")]
_OPPOSITES = [("hot", "cold", "warm"), ("up", "down", "high"), ("big", "small", "large"), ("early", "late", "soon")]
_OPPOSITES += [("open", "closed", "wide"), ("fast", "slow", "quick"), ("light", "dark", "bright")]
_FILLER = (
    "The river runs past the old mill, where the miller keeps a ledger of every sack of grain. "
    "Each morning he writes the weather, the water level and the names of the farmers who came. "
)


def toy_preference_rows(n: int = 96, seed: int = 0, long_every: int = 4, long_chars: int = 900) -> List[Dict[str, str]]:
    """`n` prompt/chosen/rejected pairs (plain text); every `long_every`-th has a context of about
    `long_chars` characters before its question (0: none)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, b = rng.randint(2, 49), rng.randint(2, 49)
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
            prompt, chosen, rejected = f"What is {a} + {b}?", f" {a + b}.", f" {wrong}."
        elif kind == 1:
            thing, right, wrong = rng.choice(_COLOURS)
            prompt, chosen, rejected = f"What colour is {thing}?", f" It is {right}.", f" It is {wrong}."
        else:
            word, right, wrong = rng.choice(_OPPOSITES)
            prompt, chosen, rejected = f"What is the opposite of '{word}'?", f" '{right}'.", f" '{wrong}'."
        if long_every and long_chars and i % long_every == long_every - 1:
            context = (_FILLER * (long_chars // len(_FILLER) + 1))[:long_chars]
            prompt = f"Read this first: {context}\nNow answer. {prompt}"
        rows.append({"prompt": f"Question: {prompt}\nAnswer:", "chosen": chosen, "rejected": rejected})
    return rows
