"""CPTrainer mixed with TRL's DPOTrainer: TRL prepares the preference data and owns the reference
model; hf_cp plans each step and computes the loss wherever the answers' tokens were placed.

    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer

    args = CPDPOConfig(output_dir="out", beta=0.1, cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    CPDPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer).train()

`pairs` is any dataset DPOTrainer takes (prompt/chosen/rejected, plain or conversational). A
vision-language policy (Qwen2-VL family) trains on text pairs, and on TRL's vision pairs (an
`images` column, the images in the prompt) given its processor as `processing_class`
(`load_vision_processor(FOLDER)` or the model's transformers processor): hf_cp tokenises those
itself (objectives/dpo_vision.py), each image expanded into its placeholder tokens, and the
planned steps encode each image once per pass (policy and reference, each with its own tower),
its rows placed in the prompt that both answers attend; each answer's M-RoPE positions are the
model's own for prompt+answer alone (data/vision_columns.shared_prompt_rope).
DPOTrainer tokenises text pairs (prompt_ids, chosen_ids, rejected_ids); each pair then becomes one
shared-prompt sample [prompt][chosen][rejected] (samples/masks.py): the prompt is computed
once, each answer attends to the prompt and to itself, and its positions continue from the
prompt's end, so each answer's log-prob is exactly the one of prompt+answer as its own sequence.
The balancer plans these samples per step like any other (local, Ulysses, ring, blocks).

A step (one optimizer step = one planned global batch of pairs):
1. forward without gradients, policy and reference (unless precomputed): each rank sums the
   per-token log-probs of the tokens it holds into the step's answer slots; one all-reduce gives
   every answer's summed log-prob on every rank;
2. the DPO loss on those whole-step vectors (objectives/dpo_loss.py, TRL's formulas), and its gradient
   with respect to each answer's log-prob, g_a;
3. forward and backward of every wave with the loss sum_a g_a * (the rank's part of log p(a)),
   whose gradient is exactly the DPO loss's (the chain rule through the sums).
The extra forward pass (1) is the price of exactness under any placement with bounded memory:
an answer's log-prob is only known once every wave that holds part of it has run, and the
waves' activations are not kept. With dropout the two forwards would differ, so dropout must be
off (`disable_dropout=True`, DPOConfig's default).

The reference: TRL's (a copy of the model, `ref_model`, or the PEFT model with its adapter
disabled), run under the same plan; or, with `precompute_ref_log_probs=True`, computed once in a
planned pass over the training data with the initial policy before the first update, and kept
in `output_dir/cp_reference_logps.json` for resumed runs.

Defaults that differ from DPOConfig's: `max_length=None` (DPOConfig truncates at 1024 tokens;
hf_cp places long pairs over CP groups and refuses, by name, a pair longer than the largest
group holds); `per_device_train_batch_size=1`, `gradient_accumulation_steps=1` (one loader item
is one planned step; size steps with cp_tokens_per_step).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

try:
    from trl import DPOConfig, DPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.dpo needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e
from accelerate.utils import is_peft_model
from datasets import IterableDataset

from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checks.answers import refuse_empty_answers
from hf_cp.train.data.collator import IGNORE_INDEX, RankStep
from hf_cp.train.data.columns import model_vocab_size
from hf_cp.train.data.vision_columns import has_vision_columns
from hf_cp.train.objectives.dpo_loss import DPOSettings, dpo_loss, pair_slots
from hf_cp.train.objectives.dpo_vision import (
    has_image_rows,
    refuse_video_rows,
    tokenise_image_pairs,
    vision_processor_of,
)
from hf_cp.train.objectives.preference import (
    check_policy_and_reference,
    policy_and_reference_logps,
    reference_logps,
    refuse_padded_batch_settings,
    refuse_reference_without_path,
    refuse_truncation,
)
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of
from hf_cp.train.setup.vision_setup import attach_vision
from hf_cp.train.step.evaluation import evaluation_data, evaluation_plans, evaluation_rank_steps
from hf_cp.train.step.executor import WaveTotals
from hf_cp.train.step.sequence_objective import (
    all_reduce_sum,
    answer_lengths,
    answer_logps_everywhere,
    train_sequence_objective,
)
from hf_cp.train.step.vision_tower import VisionTower, vision_tower_of
from hf_cp.train.trainer import CPTrainer

logger = logging.getLogger(__name__)

REFERENCE_FILE = "cp_reference_logps.json"


@dataclass
@keep_defaults_of(DPOConfig)
class CPDPOConfig(CPTrainingArguments, DPOConfig):
    """DPOConfig (the preference loss, the reference model) plus CPTrainingArguments (planning)."""

    max_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "must stay None: hf_cp never truncates a pair (it refuses, naming it, a pair longer than its "
            "largest CP group holds)"
        },
    )


def pair_sample(example: dict, index: int) -> dict:
    """One tokenised DPO pair -> one shared-prompt sample: input_ids prompt+chosen+rejected, the
    prompt unlabelled, the mask in the `attn_mask` column. Errors name the pair."""
    prompt, chosen, rejected = (list(example[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    if not prompt:
        raise ValueError(
            f"DPO pair {index}: the prompt has no tokens (the answers' first tokens would have no context)"
        )
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if not ids:
            raise ValueError(f"DPO pair {index}: the {name} answer has no tokens")
    if chosen == rejected:
        raise ValueError(
            f"DPO pair {index}: the chosen and rejected answers are the same {len(chosen)} tokens; the pair carries no "
            "preference (its DPO gradient is zero)"
        )
    mask = SampleMask.shared_prompt(len(prompt), [len(chosen), len(rejected)])
    return {
        "input_ids": prompt + chosen + rejected,
        "labels": [IGNORE_INDEX] * len(prompt) + chosen + rejected,
        MASK_COLUMN: encode_mask(mask),
    }


class CPDPOTrainer(CPTrainer, DPOTrainer):
    """DPOTrainer's data and reference model, CPTrainer's planned steps, the DPO loss computed
    from each answer's summed log-prob wherever its tokens ran. Takes DPOTrainer's arguments
    plus `balancer`; `args` must be a CPDPOConfig."""

    cp_shared_prompt_samples = True
    cp_vision_pairs = True  # TRL's vision pairs: their images sit in the prompt (objectives/dpo_vision.py)

    def __init__(self, model=None, ref_model=None, args: Optional[CPDPOConfig] = None, train_dataset=None, **kwargs):
        if not isinstance(args, CPDPOConfig):
            raise TypeError(
                f"CPDPOTrainer needs CPDPOConfig (DPOConfig + CPTrainingArguments), got {type(args).__name__}"
            )
        self.cp_dpo = self.cp_check_arguments(args)  # before any work
        if isinstance(train_dataset, IterableDataset):
            raise ValueError(
                "CPDPOTrainer: a streaming train_dataset is not supported (TRL's pair pipeline and the reference "
                "pass need the whole dataset); materialise it first (Dataset.from_generator) or use CPTrainer"
            )
        self.cp_check_datasets(train_dataset, kwargs.get("eval_dataset"), kwargs.get("processing_class"))
        self._cp_reference_table: Optional[Dict[int, Tuple[float, float]]] = None
        # the reference model's own tower in a vision-language run (its passes encode the images again)
        self._cp_ref_vision: Optional[VisionTower] = None
        refuse_reference_without_path(args, model, ref_model, "CPDPOTrainer")
        self._cp_vision_processor = None
        train_dataset, kwargs = self._cp_image_pairs(train_dataset, args, kwargs)
        super().__init__(model=model, args=args, train_dataset=train_dataset, ref_model=ref_model, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "CPDPOTrainer: the model returns a MoE router auxiliary loss (router_aux_loss_coef != 0), which hf_cp's "
                "planned forward does not collect; set router_aux_loss_coef=0"
            )
        check_policy_and_reference(self, "CPDPOTrainer", "DPOConfig")
        if self.cp_vision is not None and self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            self._cp_ref_vision = vision_tower_of(reference, "CPDPOTrainer: ref_model")

    def _cp_image_pairs(self, train_dataset, args, kwargs):
        """TRL's vision pairs (train and eval), tokenised by hf_cp before TRL sees them (TRL would
        leave them to its collator, which the planned steps replace); processing_class becomes the
        processor's tokenizer for TRL. Text pairs pass unchanged."""
        eval_dataset = kwargs.get("eval_dataset")
        evals = eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset}
        if not has_image_rows(train_dataset) and not any(has_image_rows(d) for d in evals.values()):
            return train_dataset, kwargs
        if not has_image_rows(train_dataset):
            raise ValueError(
                "CPDPOTrainer: the eval pairs have images but the training pairs do not; a run evaluates images "
                "with the tower it trains (give the training pairs their images, or evaluate text pairs)"
            )
        self._cp_vision_processor = vision_processor_of(kwargs.get("processing_class"), "CPDPOTrainer")
        kwargs = dict(kwargs, processing_class=self._cp_vision_processor.tokenizer)
        train_dataset = self._prepare_dataset(train_dataset, None, args, "train")
        if eval_dataset is not None:
            # text eval pairs are left to TRL's pipeline, which runs once TRL has set its tokenizer up
            prepared = {
                k: self._prepare_dataset(d, None, args, k) if has_image_rows(d) else d for k, d in evals.items()
            }
            kwargs["eval_dataset"] = prepared if isinstance(eval_dataset, dict) else prepared["eval"]
        return train_dataset, kwargs

    @staticmethod
    def cp_check_arguments(args) -> DPOSettings:
        """Every refusal that reads only `args` (the trainer's, and `hf-cp train --dry-run`'s, with no
        model built); returns the loss's settings."""
        refuse_truncation(args, "CPDPOTrainer", "pairs")
        refuse_padded_batch_settings(args, "CPDPOTrainer")
        if args.precompute_ref_log_probs and args.sync_ref_model:  # TRL refuses it too, after building a model
            raise ValueError("CPDPOTrainer: precompute_ref_log_probs=True cannot follow a synced reference model")
        return DPOSettings.from_config(args)  # unsupported loss settings

    @staticmethod
    def cp_check_datasets(train_dataset, eval_dataset, processing_class=None) -> None:
        """The refusals that read only the rows and the processing class (the trainer's, and
        `hf-cp train --dry-run`'s, which has none: `hf-cp train` gives DPO the model's tokenizer):
        pairs with video, and pairs with images without the model's processor."""
        evals = eval_dataset if isinstance(eval_dataset, dict) else {"eval_dataset": eval_dataset}
        datasets = {"train_dataset": train_dataset, **evals}
        for name, dataset in datasets.items():
            refuse_video_rows(dataset, name, "CPDPOTrainer")
        if any(has_image_rows(d) for d in datasets.values()):
            vision_processor_of(processing_class, "CPDPOTrainer")

    # ------------------------------------------------------------------ data (TRL's pipeline, then one sample per pair)
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        columns = list(getattr(dataset, "column_names", None) or [])
        if MASK_COLUMN in columns and "prompt_ids" in columns:  # pairs with images, joined before TRL's set-up
            return dataset
        refuse_video_rows(dataset, dataset_name, "CPDPOTrainer")
        refuse_empty_answers(dataset, dataset_name)  # before TRL turns an empty answer into EOS alone
        if has_image_rows(dataset):
            if self._cp_vision_processor is None:  # evaluate() on image pairs after text training
                raise ValueError(
                    f"CPDPOTrainer: {dataset_name} has pairs with images, but the training pairs have none; a run "
                    "evaluates images with the tower it trains (give the training pairs their images)"
                )
            prepared = tokenise_image_pairs(dataset, self._cp_vision_processor, dataset_name, args.dataset_num_proc)
        elif has_vision_columns(columns):
            found = ", ".join(c for c in columns if has_vision_columns([c]))
            raise ValueError(
                f"CPDPOTrainer: {dataset_name} has vision columns ({found}) beside text pairs, whose prompts hold no "
                "image placeholders: give TRL's vision pairs instead (an `images` column, the images in the prompt) "
                "with the model's processor as processing_class"
            )
        else:
            prepared = DPOTrainer._prepare_dataset(self, dataset, processing_class, args, dataset_name)
        return prepared.map(
            pair_sample, with_indices=True, desc=f"Joining {dataset_name} pairs into shared-prompt samples"
        )

    def _precompute_ref_logps(self, dataset, name, batch_size):
        # hf_cp computes them in a planned pass before the first update (_cp_reference_logps)
        return dataset

    # ------------------------------------------------------------------ reference log-probs
    def _cp_reference_pass(self, step: RankStep) -> torch.Tensor:
        """This rank's part of every answer's reference log-prob (forward only)."""
        return reference_logps(
            self.cp_runtime.executor, self.accelerator, self.model, self.ref_model, step, self._cp_ref_vision
        )

    def _cp_reference_file(self) -> Path:
        return Path(self.args.output_dir) / REFERENCE_FILE

    def _cp_precompute_references(self) -> Dict[int, Tuple[float, float]]:
        """Every training pair's reference log-probs, from a planned pass over the training data
        with the policy before its first update; written to output_dir for resumed runs."""
        path = self._cp_reference_file()
        digest = self.cp_data.digest()
        if self.state.global_step > 0:  # a resumed run: the policy is no longer the reference
            if not path.exists():
                raise FileNotFoundError(
                    f"CPDPOTrainer: resuming at step {self.state.global_step} with precompute_ref_log_probs=True needs "
                    f"the reference log-probs of the first run, {path}, which is missing"
                )
            saved = json.loads(path.read_text())
            if saved.get("data_digest") != digest:
                raise ValueError(f"CPDPOTrainer: {path} was computed for other training data; remove it to recompute")
            return {int(k): (float(v[0]), float(v[1])) for k, v in saved["pairs"].items()}
        plans = evaluation_plans(self.cp_data, "train_dataset (reference log-probs)", *self._cp_evaluation_settings())
        table: Dict[int, Tuple[float, float]] = {}
        was_training = self.model.training
        self.model.eval()
        try:
            for step in evaluation_rank_steps(plans, self.cp_data, self.cp_rank):
                self.cp_runtime.check_attention(self.model, step, "reference log-prob batch")
                sums = self._cp_all_reduce(self._cp_reference_pass(step))
                samples, chosen, rejected = pair_slots(step.answer_slots)
                for sid, c, r in zip(samples, chosen, rejected):
                    table[sid] = (float(sums[c]), float(sums[r]))
        finally:
            self.model.train(was_training)
        if self.cp_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"data_digest": digest, "pairs": {str(k): v for k, v in table.items()}}))
            tmp.replace(path)
        return table

    def _cp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.cp_world)

    # ------------------------------------------------------------------ one step
    @property
    def cp_forward_only_passes(self) -> int:
        """The policy's log-prob pass, and the reference's unless its log-probs are precomputed."""
        return 1 if self.precompute_ref_logps else 2

    def _cp_pair_logps(self, step: RankStep, model) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every answer's summed log-prob of the step, policy and reference, on every rank."""
        policy = self.accelerator.unwrap_model(model)
        if self.precompute_ref_logps:
            if self._cp_reference_table is None:
                self._cp_reference_table = self._cp_precompute_references()
            own = answer_logps_everywhere(self.cp_runtime.executor, policy, step, self.cp_world)
            ref = torch.zeros_like(own)
            for k, (sid, a) in enumerate(step.answer_slots):
                ref[k] = self._cp_reference_table[sid][a]
            return own, ref
        return policy_and_reference_logps(
            self.cp_runtime.executor,
            self.accelerator,
            policy,
            self.ref_model,
            step,
            self.cp_world,
            ref_vision=self._cp_ref_vision,
        )

    def _cp_train_waves(self, model, step: RankStep) -> Tuple[WaveTotals, Optional[float]]:
        """DPO's loss of every pair's summed log-probs, trained through the sequence-objective seam."""
        samples, chosen, rejected = pair_slots(step.answer_slots)
        policy, reference = self._cp_pair_logps(step, model)
        tokens = answer_lengths(step, self.cp_data.masks).to(policy.device)

        def loss_of(logps: torch.Tensor):
            return dpo_loss(
                self.cp_dpo,
                logps[chosen],
                logps[rejected],
                reference[chosen],
                reference[rejected],
                tokens[chosen],
                tokens[rejected],
            )

        totals, loss, metrics = train_sequence_objective(self.cp_runtime.executor, model, step, policy, loss_of)
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        return totals, loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> Dict[str, float]:
        """The DPO loss and TRL's reward metrics over the eval pairs (planned like training):
        {prefix}_loss, {prefix}_rewards/..., {prefix}_logps/..., {prefix}_samples, {prefix}_runtime."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("CPDPOTrainer.evaluate: no eval_dataset (pass one to evaluate() or to the trainer)")
        if isinstance(ds, dict):
            metrics: Dict[str, float] = {}
            for name, part in ds.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if "input_ids" not in getattr(ds, "column_names", ["input_ids"]):  # raw pairs: TRL's pipeline first
            ds = self._prepare_dataset(ds, self.processing_class, self.args, metric_key_prefix)
        if self.precompute_ref_logps and self.ref_model is None and not is_peft_model(self.model):
            raise ValueError(
                "CPDPOTrainer.evaluate: with precompute_ref_log_probs=True and no ref_model there is no reference "
                "model left to score eval pairs with; pass ref_model"
            )
        self._cp_setup()
        t0 = time.perf_counter()
        name = f"eval dataset {metric_key_prefix!r}"
        data, plans = evaluation_data(ds, name, *self._cp_evaluation_settings(), model_vocab_size(self.model))
        if has_vision_columns(getattr(ds, "column_names", None) or []):  # pairs with images (see _prepare_dataset)
            attach_vision(ds, data, self.model, "CPDPOTrainer", name, self.cp_sharding, True, self.cp_vision, True)
        model = self.model
        if next(model.parameters()).device != self.args.device:
            model = model.to(self.args.device)
        pairs: Dict[int, List[float]] = {}
        was_training = model.training
        model.eval()
        try:
            for step in evaluation_rank_steps(plans, data, self.cp_rank):
                self.cp_runtime.check_attention(self.model, step, "evaluation batch")
                with torch.no_grad():
                    own = self.cp_runtime.executor.answer_logps(model, step)
                    ref = self._cp_reference_pass(step)
                both = self._cp_all_reduce(torch.stack([own, ref]))
                samples, chosen, rejected = pair_slots(step.answer_slots)
                for sid, c, r in zip(samples, chosen, rejected):
                    m = data.masks[sid]
                    pairs[sid] = [float(both[0, c]), float(both[0, r]), float(both[1, c]), float(both[1, r])]
                    pairs[sid] += [float(m.answers[0]), float(m.answers[1])]
        finally:
            model.train(was_training)
        v = torch.tensor(np.asarray([pairs[s] for s in sorted(pairs)]), dtype=torch.float64)
        with torch.no_grad():
            loss, reward_metrics = dpo_loss(self.cp_dpo, v[:, 0], v[:, 1], v[:, 2], v[:, 3], v[:, 4], v[:, 5])
        out = {f"{metric_key_prefix}_loss": float(loss), f"{metric_key_prefix}_samples": float(len(pairs))}
        out.update({f"{metric_key_prefix}_{k}": val for k, val in reward_metrics.items()})
        out[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - t0, 4)
        model.eval()  # DPOTrainer.log adds the metrics of the mode the model is in
        self.log(out)
        model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, out)
        return out
