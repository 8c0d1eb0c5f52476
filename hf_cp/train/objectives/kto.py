"""CPTrainer mixed with TRL's KTOTrainer: TRL prepares the unpaired preference data (and unpairs
paired data) and owns the reference model; hf_cp plans each step and computes the KTO loss
wherever the completions' tokens were placed.

    from hf_cp.train.objectives.kto import CPKTOConfig, CPKTOTrainer

    args = CPKTOConfig(output_dir="out", beta=0.1, cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    CPKTOTrainer(model=model, args=args, train_dataset=examples, processing_class=tokenizer).train()

`examples` is any dataset KTOTrainer takes (prompt/completion/label, or prompt/chosen/rejected
pairs, plain or conversational). KTOTrainer tokenises it (prompt_ids, completion_ids) and, for
the loss types with a KL term, gives each example a mismatched completion (KL_completion_ids):
completions rotated by one within consecutive runs of `cp_kl_batch_size` examples, TRL's rule
with its per_device_train_batch_size. Each example then becomes one shared-prompt sample
[prompt][completion][mismatched completion] (samples/masks.py): the prompt computed once, each
answer attending to the prompt and to itself, so each answer's summed log-prob is exactly the
one of prompt+answer as its own sequence. The balancer plans these samples per step like any
other (local, Ulysses, ring, blocks).

A step (one optimizer step = one planned global batch of examples), through the sequence-
objective seam (step/sequence_objective.py):
1. forward without gradients, policy and reference: every answer's summed log-prob on every rank
   (one all-reduce);
2. the KL estimate z0 (the mean over the step's mismatched pairs of policy minus reference,
   clamped at 0, no gradient) and the KTO loss on the whole-step vectors (objectives/kto_loss.py,
   TRL's formulas), differentiated with respect to each completion's log-prob;
3. forward and backward of every wave with those weights (the mismatched completions' weights
   are 0: z0 carries no gradient, as in TRL).
The step's loss and gradients are TRL's on the same batch of examples (with TRL's batch being
the whole global batch). hf_cp's steps are sized by tokens (cp_tokens_per_step), so a step's
mismatched completions come from the examples' neighbours in the dataset's order, which may sit
in another step under cp_shuffle: z0 stays an estimate over mismatched pairs, fixed for the run.

Refused by name: precompute_ref_log_probs (pass ref_model, or train a PEFT adapter), max_length
(hf_cp never truncates; an example longer than the largest CP group holds is refused, named),
padded-batch and offloading settings, active dropout, a streaming dataset, vision datasets, MoE
auxiliary losses. Under FSDP2 and ZeRO-3 every forward-only pass (policy and reference) runs
the wave's pass count on every rank (the executor's aligned dummies), as training does.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

try:
    from trl import KTOConfig, KTOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.kto needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e
from datasets import IterableDataset

from hf_cp.samples.mask_column import MASK_COLUMN, encode_mask
from hf_cp.samples.masks import SampleMask
from hf_cp.train.checks.answers import EXAMPLE_COLUMNS, refuse_empty_answers
from hf_cp.train.checks.media import SHARED_PROMPT_IMAGES_INSTEAD, SHARED_PROMPT_IMAGES_WHY, refuse_raw_images
from hf_cp.train.data.collator import IGNORE_INDEX, RankStep
from hf_cp.train.data.columns import model_vocab_size
from hf_cp.train.objectives.kto_loss import KL_LOSS_TYPES, KTOSettings, kl_estimate, kto_loss
from hf_cp.train.objectives.preference import (
    check_policy_and_reference,
    policy_and_reference_logps,
    refuse_padded_batch_settings,
    refuse_truncation,
)
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of
from hf_cp.train.step.evaluation import evaluation_data, evaluation_rank_steps
from hf_cp.train.step.executor import WaveTotals
from hf_cp.train.step.sequence_objective import train_sequence_objective
from hf_cp.train.trainer import CPTrainer

TEXT_COLUMNS = EXAMPLE_COLUMNS  # the text TRL tokenises


@dataclass
@keep_defaults_of(KTOConfig)
class CPKTOConfig(CPTrainingArguments, KTOConfig):
    """KTOConfig (the loss, the reference model) plus CPTrainingArguments (planning)."""

    max_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "must stay None: hf_cp never truncates an example (it refuses, naming it, an example longer than "
            "its largest CP group holds)"
        },
    )
    cp_kl_batch_size: int = field(
        default=8,
        metadata={
            "help": "the KL term's mismatched pairs: completions rotate by one within consecutive runs of this many "
            "examples (TRL's per_device_train_batch_size; hf_cp's steps are sized by tokens)"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type in KL_LOSS_TYPES and self.cp_kl_batch_size < 2:
            raise ValueError(
                f"CPKTOConfig: cp_kl_batch_size={self.cp_kl_batch_size}: the KL term pairs each prompt with another "
                "example's completion, which needs runs of at least 2 examples"
            )


def kto_sample(example: dict, index: int) -> dict:
    """One tokenised KTO example -> one shared-prompt sample: input_ids prompt+completion(+the
    mismatched completion), the prompt unlabelled, the mask in the `attn_mask` column."""
    prompt, completion = list(example["prompt_ids"]), list(example["completion_ids"])
    if not prompt:
        raise ValueError(
            f"KTO example {index}: the prompt has no tokens (the completion's first token would have no context)"
        )
    if not completion:
        raise ValueError(f"KTO example {index}: the completion has no tokens")
    answers = [completion]
    if example.get("KL_completion_ids") is not None:
        answers.append(list(example["KL_completion_ids"]))
    mask = SampleMask.shared_prompt(len(prompt), [len(a) for a in answers])
    ids = prompt + [t for a in answers for t in a]
    return {
        "input_ids": ids,
        "labels": [IGNORE_INDEX] * len(prompt) + ids[len(prompt) :],
        MASK_COLUMN: encode_mask(mask),
    }


def kto_slots(answer_slots, with_kl: bool) -> Tuple[List[int], List[int], List[int]]:
    """(sample ids, completion slots, mismatched-completion slots) of a step of KTO samples
    (answer 0 the completion, answer 1 the mismatched one when the loss has a KL term)."""
    per: Dict[int, Dict[int, int]] = {}
    for k, (sid, a) in enumerate(answer_slots):
        per.setdefault(sid, {})[a] = k
    expected = [0, 1] if with_kl else [0]
    samples, completion, mismatched = [], [], []
    for sid, answers in per.items():
        if sorted(answers) != expected:
            raise ValueError(
                f"sample {sid} has {len(answers)} answers; a KTO sample is one prompt with its completion"
                + (" and a mismatched completion" if with_kl else "")
            )
        samples.append(sid)
        completion.append(answers[0])
        if with_kl:
            mismatched.append(answers[1])
    return samples, completion, mismatched


@contextlib.contextmanager
def kl_runs(args: CPKTOConfig):
    """args.per_device_train_batch_size set to cp_kl_batch_size meanwhile: TRL reads that setting
    for its KL check and for the runs its mismatched completions rotate within, while hf_cp's
    loader items are whole planned steps (per_device_train_batch_size 1)."""
    kept = args.per_device_train_batch_size
    args.per_device_train_batch_size = args.cp_kl_batch_size
    try:
        yield
    finally:
        args.per_device_train_batch_size = kept


class _KTOWithKLRuns(KTOTrainer):
    """KTOTrainer constructed under kl_runs (its KL check and the training and eval datasets'
    mismatched completions)."""

    def __init__(self, *args, **kwargs):
        with kl_runs(kwargs["args"]):
            super().__init__(*args, **kwargs)
        self._train_batch_size = self.args.train_batch_size


class CPKTOTrainer(CPTrainer, _KTOWithKLRuns):
    """KTOTrainer's data and reference model, CPTrainer's planned steps, the KTO loss computed
    from each completion's summed log-prob wherever its tokens ran. Takes KTOTrainer's arguments
    plus `balancer`; `args` must be a CPKTOConfig."""

    cp_shared_prompt_samples = True

    def __init__(self, model=None, ref_model=None, args: Optional[CPKTOConfig] = None, train_dataset=None, **kwargs):
        if not isinstance(args, CPKTOConfig):
            raise TypeError(
                f"CPKTOTrainer needs CPKTOConfig (KTOConfig + CPTrainingArguments), got {type(args).__name__}"
            )
        self.cp_kto = self.cp_check_arguments(args)  # before any work
        if isinstance(train_dataset, IterableDataset):
            raise ValueError(
                "CPKTOTrainer: a streaming train_dataset is not supported (TRL's example pipeline needs the whole "
                "dataset); materialise it first (Dataset.from_generator) or use CPTrainer"
            )
        datasets = {"train_dataset": train_dataset, "eval_dataset": kwargs.get("eval_dataset")}
        refuse_raw_images(datasets, "CPKTOTrainer", SHARED_PROMPT_IMAGES_WHY, SHARED_PROMPT_IMAGES_INSTEAD)
        super().__init__(model=model, args=args, train_dataset=train_dataset, ref_model=ref_model, **kwargs)
        if self._is_vision_dataset:
            raise ValueError(
                "CPKTOTrainer: vision datasets are not supported (image features cannot be placed in a planned token "
                "layout); pass text examples and a text tokenizer as processing_class"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "CPKTOTrainer: the model returns a MoE router auxiliary loss (router_aux_loss_coef != 0), which hf_cp's "
                "planned forward does not collect; set router_aux_loss_coef=0"
            )
        check_policy_and_reference(self, "CPKTOTrainer", "KTOConfig")
        self._cp_desirable = np.asarray(self.train_dataset["label"], dtype=bool)

    @staticmethod
    def cp_check_arguments(args) -> KTOSettings:
        """Every refusal that reads only `args` (the trainer's, and `hf-cp train --dry-run`'s, with no
        model built); returns the loss's settings."""
        refuse_truncation(args, "CPKTOTrainer", "examples")
        if args.precompute_ref_log_probs:
            raise ValueError(
                "CPKTOTrainer: precompute_ref_log_probs=True is not supported yet; pass ref_model (a copy of the "
                "initial policy) or train a PEFT adapter (the reference is the adapter disabled)"
            )
        refuse_padded_batch_settings(args, "CPKTOTrainer")
        return KTOSettings.from_config(args)  # unsupported loss types

    # ------------------------------------------------------------------ data (TRL's pipeline, then one sample each)
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # before TRL turns an empty completion into EOS alone
        refuse_empty_answers(dataset, dataset_name, "CPKTOTrainer", TEXT_COLUMNS, "example")
        with kl_runs(args):  # also for a dataset given to evaluate() after construction
            prepared = KTOTrainer._prepare_dataset(self, dataset, processing_class, args, dataset_name)
        return prepared.map(kto_sample, with_indices=True, desc=f"Joining {dataset_name} examples into samples")

    # ------------------------------------------------------------------ one step
    @property
    def cp_forward_only_passes(self) -> int:
        """The policy's and the reference's log-prob passes (the KL completions ride in the same samples)."""
        return 2

    def _cp_kto_loss(self, step: RankStep, desirable_of, model):
        """(every answer's summed log-prob under the policy, the step's loss of them) on every rank."""
        samples, completion, mismatched = kto_slots(step.answer_slots, self.cp_kto.uses_kl)
        policy = self.accelerator.unwrap_model(model)
        own, ref = policy_and_reference_logps(
            self.cp_runtime.executor, self.accelerator, policy, self.ref_model, step, self.cp_world
        )
        desirable = torch.as_tensor(desirable_of[samples], dtype=torch.bool, device=own.device)
        kl = kl_estimate(own[mismatched], ref[mismatched]) if self.cp_kto.uses_kl else kl_estimate(None, None)

        def loss_of(logps: torch.Tensor):
            return kto_loss(self.cp_kto, logps[completion], ref[completion], desirable, kl)

        return own, loss_of

    def _cp_train_waves(self, model, step: RankStep) -> Tuple[WaveTotals, Optional[float]]:
        """KTO's loss of every completion's summed log-prob, trained through the sequence-objective seam."""
        own, loss_of = self._cp_kto_loss(step, self._cp_desirable, model)
        totals, loss, metrics = train_sequence_objective(self.cp_runtime.executor, model, step, own, loss_of)
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        return totals, loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> Dict[str, float]:
        """The KTO loss and TRL's reward metrics over the eval examples (planned like training),
        with one KL estimate over the whole eval set: {prefix}_loss, {prefix}_kl,
        {prefix}_rewards/..., {prefix}_logps/..., {prefix}_samples, {prefix}_runtime. TRL's own
        evaluate averages per-batch losses, each with its batch's estimate; the two agree when
        the eval set is one batch."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("CPKTOTrainer.evaluate: no eval_dataset (pass one to evaluate() or to the trainer)")
        if isinstance(ds, dict):
            metrics: Dict[str, float] = {}
            for name, part in ds.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if "input_ids" not in getattr(ds, "column_names", ["input_ids"]):  # raw examples: TRL's pipeline first
            ds = self._prepare_dataset(ds, self.processing_class, self.args, metric_key_prefix)
        self._cp_setup()
        t0 = time.perf_counter()
        data, plans = evaluation_data(
            ds, f"eval dataset {metric_key_prefix!r}", *self._cp_evaluation_settings(), model_vocab_size(self.model)
        )
        model = self.model
        if next(model.parameters()).device != self.args.device:
            model = model.to(self.args.device)
        # sample id -> [policy, reference] log-prob of its completion and, with the KL term, its mismatched one
        rows: Dict[int, List[float]] = {}
        was_training = model.training
        model.eval()
        try:
            for step in evaluation_rank_steps(plans, data, self.cp_rank):
                self.cp_runtime.check_attention(self.model, step, "evaluation batch")
                own, ref = policy_and_reference_logps(
                    self.cp_runtime.executor, self.accelerator, model, self.ref_model, step, self.cp_world
                )
                samples, completion, mismatched = kto_slots(step.answer_slots, self.cp_kto.uses_kl)
                for i, sid in enumerate(samples):
                    rows[sid] = [float(own[completion[i]]), float(ref[completion[i]])]
                    if mismatched:
                        rows[sid] += [float(own[mismatched[i]]), float(ref[mismatched[i]])]
        finally:
            model.train(was_training)
        ids = sorted(rows)
        v = torch.tensor(np.asarray([rows[s] for s in ids]), dtype=torch.float64)
        desirable = torch.as_tensor(np.asarray(ds["label"], dtype=bool)[ids])
        kl = kl_estimate(v[:, 2], v[:, 3]) if self.cp_kto.uses_kl else kl_estimate(None, None)
        with torch.no_grad():
            loss, loss_metrics = kto_loss(self.cp_kto, v[:, 0], v[:, 1], desirable, kl)
        out = {f"{metric_key_prefix}_loss": float(loss), f"{metric_key_prefix}_samples": float(len(ids))}
        out.update({f"{metric_key_prefix}_{k}": val for k, val in loss_metrics.items()})
        out[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - t0, 4)
        model.eval()  # KTOTrainer.log adds the metrics of the mode the model is in
        self.log(out)
        model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, out)
        return out
