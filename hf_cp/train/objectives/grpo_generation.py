"""GRPO's generation side as hf_cp's policy step needs it: TRL's generation output gathered from
every process into one rollout, reward functions guarded so that one that raises stops every
rank (no rank left waiting in a collective), and the reference model kept loadable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from accelerate.utils import gather_object
from safetensors.torch import save_model
from trl.trainer.utils import is_async_callable  # trl

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function raised; raised on every rank, naming the function and the group."""


@dataclass
class GRPORollout:
    """Every row of one generation batch (all processes, TRL's order): rows p*B_p .. (p+1)*B_p - 1
    came from process p, and rows g*G .. (g+1)*G - 1 are group g (one prompt, G completions)."""

    prompts: List[List[int]]  # prompt tokens, padding removed
    completions: List[List[int]]  # completion tokens (completion_mask), padding removed
    loss_masks: List[np.ndarray]  # per completion token: 1 where TRL takes loss (completion x tool mask)
    advantages: List[np.ndarray]  # per row: [1] (a row's advantage) or [n] (per token)
    old: Optional[List[np.ndarray]]  # TRL's per-token log-probs at generation (None: on-policy)
    ref: Optional[List[np.ndarray]]  # the reference's (None: beta == 0)
    processes: List[int]
    num_generations: int
    per_token_advantages: bool = False  # advantages of shape [rows, tokens] (a GRPOTrainer subclass's)
    # [rows] RLOO's summed log-probs at the rollout's first planned step, under the policy that
    # generated it: TRL's old_logps without its generation pass's kernel noise (NaN: not trained)
    policy_sums: Optional[np.ndarray] = None
    # per row: its prompt's images as TRL's processor gave them (pixel_values rows, image_grid_thw),
    # None for a row without images; None altogether in a text run
    images: Optional[List[Optional[Tuple[np.ndarray, np.ndarray]]]] = None

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def counts(self) -> np.ndarray:
        return np.asarray([float(m.sum()) for m in self.loss_masks], dtype=np.float64)


def row_images(out: dict, rows: int) -> Optional[List[Optional[Tuple[np.ndarray, np.ndarray]]]]:
    """Each row's images of TRL's generation output (a vision run: `pixel_values` and
    `image_grid_thw` of every row's images in row order, `num_images` per row), as
    (pixel rows, grids) per row; None in a text run."""
    grid = out.get("image_grid_thw")
    if grid is None or out.get("pixel_values") is None:
        return None
    pixels = out["pixel_values"].detach().float().cpu().numpy()
    grid = grid.detach().cpu().numpy().astype(np.int64)
    counts = out.get("num_images") or [0] * rows
    per_image = grid.prod(axis=1)
    got: List[Optional[Tuple[np.ndarray, np.ndarray]]] = []
    image, row = 0, 0
    for n in counts:
        if not n:
            got.append(None)
            continue
        patches = int(per_image[image : image + n].sum())
        got.append((pixels[row : row + patches], grid[image : image + n]))
        image, row = image + n, row + patches
    if row != len(pixels) or image != len(grid):
        raise ValueError(
            f"TRL's generation output has {len(pixels)} pixel rows and {len(grid)} image grids, but its rows' "
            f"num_images {list(counts)} account for {row} rows of {image} images"
        )
    return got


def gather_rollout(out: dict, world: int, num_generations: int) -> GRPORollout:
    """Every process's rows of TRL's generation output (`out`), padding removed, on every rank
    (a vision run: each row's images too, row_images)."""
    prompt_mask = out["prompt_mask"].bool().cpu()
    completion_mask = out["completion_mask"].cpu()
    loss_mask = completion_mask * out["tool_mask"].cpu() if "tool_mask" in out else completion_mask
    adv = out["advantages"].detach().float().cpu()
    old, ref = out.get("old_per_token_logps"), out.get("ref_per_token_logps")
    old = None if old is None else old.detach().float().cpu()
    ref = None if ref is None else ref.detach().float().cpu()
    prompt_ids, completion_ids = out["prompt_ids"].cpu(), out["completion_ids"].cpu()
    images = row_images(out, prompt_ids.shape[0])
    rows = []
    for i in range(prompt_ids.shape[0]):
        n = int(completion_mask[i].sum())
        a = adv[i].reshape(-1)[:n] if adv.dim() == 2 else adv[i].reshape(1)
        rows.append(
            (
                prompt_ids[i][prompt_mask[i]].tolist(),
                completion_ids[i, :n].tolist(),
                loss_mask[i, :n].float().numpy(),
                a.numpy(),
                None if old is None else old[i, :n].numpy(),
                None if ref is None else ref[i, :n].numpy(),
                None if images is None else images[i],
            )
        )
    per_process = gather_object([rows]) if world > 1 else [rows]
    flat = [(p, r) for p, part in enumerate(per_process) for r in part]
    return GRPORollout(
        prompts=[r[0] for _, r in flat],
        completions=[r[1] for _, r in flat],
        loss_masks=[r[2] for _, r in flat],
        advantages=[r[3] for _, r in flat],
        old=None if old is None else [r[4] for _, r in flat],
        ref=None if ref is None else [r[5] for _, r in flat],
        processes=[p for p, _ in flat],
        num_generations=num_generations,
        per_token_advantages=adv.dim() == 2,
        images=[r[6] for _, r in flat] if any(r[6] is not None for _, r in flat) else None,
    )


def guarded_reward(func, name: str, failures: List[str], rows: int, process: int, size: int, step: int):
    """`func` (a reward function) guarded: where it raises, its rows get None rewards (so TRL's
    gather completes on every process) and `failures` gets a line naming the function, the
    first group that raises alone (rows of `size` completions), the process and the prompt.
    `rows`: this process's rows; `step`: the Trainer's step, from 1."""
    if isinstance(func, torch.nn.Module):  # a reward model: TRL runs it as a module
        return func
    first = process * rows  # this process's first row of the generation batch

    def groups_of(kwargs):
        """(group, its rows' keyword arguments) of this process's rows."""
        local = list(range(rows))
        for g in sorted({(first + i) // size for i in local}):
            mine = [i for i in local if (first + i) // size == g]
            yield (
                g,
                {k: ([v[i] for i in mine] if isinstance(v, list) and len(v) == rows else v) for k, v in kwargs.items()},
            )

    def describe(g, kwargs, err: BaseException) -> str:
        prompt = kwargs.get("prompts", [None])[0]
        return (
            f"step {step}: reward function {name!r} raised {type(err).__name__}: {err} on "
            f"GRPO group {g} of the generation batch (rows {g * size}..{(g + 1) * size - 1}, process "
            f"{process}, prompt {str(prompt)[:80]!r})"
        )

    if is_async_callable(func):

        async def guarded(**kwargs):
            try:
                return await func(**kwargs)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank by _calculate_rewards
                for g, part in groups_of(kwargs):
                    try:
                        await func(**part)
                    except Exception as one:  # noqa: BLE001
                        failures.append(describe(g, part, one))
                        break
                else:
                    failures.append(describe(first // size, kwargs, err) + " (no group alone raised)")
                return [None] * rows

        return guarded

    def guarded(**kwargs):
        try:
            return func(**kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank by _calculate_rewards
            for g, part in groups_of(kwargs):
                try:
                    func(**part)
                except Exception as one:  # noqa: BLE001
                    failures.append(describe(g, part, one))
                    break
            else:
                failures.append(describe(first // size, kwargs, err) + " (no group alone raised)")
            return [None] * rows

    return guarded


REFERENCE_INIT = "reference_init"  # in output_dir: the initial policy, where TRL loads the reference from


def keep_reference_loadable(model, output_dir: str, rank: int) -> Optional[str]:
    """TRL builds GRPO's reference model (beta > 0) by loading the policy's `_name_or_path` again.
    A policy built in memory, or read from a GGUF file (the bundled SmolLM2: a package folder
    without config.json), has no loadable path there, and TRL failed with "Unrecognized model".
    Such a policy is saved as it is now, before training (the reference a KL term wants), to
    output_dir/reference_init/rank<r> (every rank its own copy: no barrier before TRL loads it),
    and its `_name_or_path` points there. Returns that folder, or None when the path loads."""
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "")
    path = Path(name).expanduser()
    if name and (path / "config.json").is_file():
        return None  # a model folder: TRL loads it
    if name and not path.exists() and "/" in name and not name.startswith(("/", ".")):
        return None  # a hub id: TRL loads it (offline from the cache)
    folder = Path(output_dir) / REFERENCE_INIT / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    # not model.save_pretrained: under torch.distributed it writes on global rank 0 only
    if not getattr(config, "architectures", None):  # TRL picks the reference's class from it
        config.architectures = [type(model).__name__]
    config.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
    config._name_or_path = str(folder)
    logger.info("hf_cp: the GRPO reference model is the initial policy, saved to %s (%r does not load)", folder, name)
    return str(folder)
