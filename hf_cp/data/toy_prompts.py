"""A toy prompt task for the GRPO and RLOO recipes and configs: plain-text prompts and a reward
that a training config can name (`reward: {functions: [hf_cp.data.toy_prompts:share_of_a]}`),
generated deterministically, no download. The reward is the share of one character in a
completion: a policy trained on it writes more of that character, so the mean reward rises."""

from __future__ import annotations

from typing import Callable, List

TOY_WORDS = ["apple", "river", "stone", "cloud", "night", "green", "music", "light"]
TOY_PROMPTS = 64  # how many the bundled dataset `toy_prompts` holds


def toy_prompts(n: int = TOY_PROMPTS) -> List[dict]:
    """Plain-text prompts for the toy task."""
    return [{"prompt": f"Task {i}: write a word like {TOY_WORDS[i % len(TOY_WORDS)]}: "} for i in range(n)]


def share_of(char: str) -> Callable[..., List[float]]:
    """The toy reward function (TRL's signature): the share of `char` among a completion's characters."""

    def reward_target_char(completions, **kwargs) -> List[float]:
        out = []
        for c in completions:
            text = c if isinstance(c, str) else " ".join(m.get("content", "") for m in c)
            out.append(text.count(char) / max(len(text), 1))
        return out

    return reward_target_char


share_of_a = share_of("a")  # the default toy reward, by name for a config's reward section
