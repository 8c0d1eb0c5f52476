"""CPTrainer mixed with TRL's SFTTrainer: TRL prepares the data, hf_cp plans and runs the steps.

    from hf_cp.train.objectives.sft import CPSFTConfig, CPSFTTrainer

    args = CPSFTConfig(output_dir="out", cp_max_tokens_per_rank=32768, cp_tokens_per_rank_per_step=65536)
    CPSFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tokenizer).train()

`raw` is any dataset SFTTrainer takes: prompt/completion (strings or messages), `messages`, or
`text`; or a processor's vision columns (input_ids, pixel_values, image_grid_thw, ...: `hf-cp
preprocess --processor`), which SFTTrainer leaves as they are and CPTrainer trains. TRL's own
vision rows (an `images` column, processed per batch by TRL's collator) are refused by name.
SFTTrainer tokenises text and builds `labels` (the completion or the assistant turns only, as
configured); CPTrainer reads that prepared dataset (`self.train_dataset`), not the raw one,
and from there every step is planned and run as in CPTrainer: SFTTrainer's loss, collator and
batching are not used. TRL is an optional extra (`pip install "hf_cp[trl]"`).

Defaults that differ from SFTConfig's, and why:
- `max_length=None`: SFTConfig truncates every sample to 1024 tokens by default; long-context
  training must not, and hf_cp refuses a sample longer than its largest CP group holds, by name.
- `per_device_train_batch_size=1`, `gradient_accumulation_steps=1`: one loader item is one
  planned step (CPTrainingArguments); size steps with cp_tokens_per_step.
- `packing=False`: hf_cp packs and balances documents itself. TRL's packed rows are read as
  their documents when they carry boundaries (seq_lengths), but packing first only to be
  unpacked again costs time and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_cp.train.objectives.sft needs TRL: pip install 'hf_cp[trl]' (or pip install 'trl>=1.16,<2')"
    ) from e

from hf_cp.train.checks.media import refuse_raw_images
from hf_cp.train.setup.args import CPTrainingArguments, keep_defaults_of
from hf_cp.train.trainer import CPTrainer

# TRL's vision-language rows (an `images` column): refused by name (checks/media.py)
IMAGE_ROWS_WHY = (
    "TRL turns their images into pixels in its collator, per padded batch, which hf_cp's planned steps replace; "
    "hf_cp reads a processor's columns (input_ids, pixel_values, image_grid_thw, ...)"
)
IMAGE_ROWS_INSTEAD = (
    "Run the rows through the model's processor first: `hf-cp preprocess DATA --processor DIR --images-field images "
    "--out OUT`, then train its output with CPTrainer or CPSFTTrainer (`hf-cp train` with trainer: cp; docs/vision.md)"
)


@dataclass
@keep_defaults_of(SFTConfig)
class CPSFTConfig(CPTrainingArguments, SFTConfig):
    """SFTConfig (how TRL prepares the data) plus CPTrainingArguments (how hf_cp plans steps)."""

    max_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "truncate samples to this many tokens (None: never; hf_cp refuses, naming it, a sample longer "
            "than its largest CP group holds)"
        },
    )

    def __post_init__(self):
        if self.packing:  # before TRL's own check, which asks for a max_length
            raise ValueError(
                "CPSFTConfig: packing=True: hf_cp already packs, per step: it plans whole samples into each step "
                "(cp_tokens_per_step) and places them on ranks, so TRL's packed rows would only be unpacked again "
                "(and its 'wrapped' strategy would cut documents apart); leave packing=False"
            )
        super().__post_init__()


class CPSFTTrainer(CPTrainer, SFTTrainer):
    """SFTTrainer's data preparation, CPTrainer's planned steps. Takes SFTTrainer's arguments plus
    `balancer`; `args` must be a CPSFTConfig."""

    def __init__(self, model=None, args: Optional[CPSFTConfig] = None, train_dataset=None, **kwargs):
        if not isinstance(args, CPSFTConfig):
            raise TypeError(
                f"CPSFTTrainer needs CPSFTConfig (SFTConfig + CPTrainingArguments), got {type(args).__name__}"
            )
        self.cp_check_arguments(args)
        self.cp_check_datasets(train_dataset, kwargs.get("eval_dataset"))
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)

    @staticmethod
    def cp_check_arguments(args) -> None:
        """Every refusal that reads only `args` (the trainer's, and `hf-cp train --dry-run`'s): none
        beyond CPSFTConfig's own (packing), made when the config is built."""

    @staticmethod
    def cp_check_datasets(train_dataset, eval_dataset) -> None:
        """The refusals that read only the rows (the trainer's, and `hf-cp train --dry-run`'s): TRL's
        vision-language rows."""
        refuse_raw_images(
            {"train_dataset": train_dataset, "eval_dataset": eval_dataset}, "CPSFTTrainer", IMAGE_ROWS_WHY,
            IMAGE_ROWS_INSTEAD,
        )  # fmt: skip

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """A dataset passed here is prepared as SFTTrainer prepares its eval dataset, then
        evaluated by CPTrainer (planned like training)."""
        refuse_raw_images({"eval_dataset": eval_dataset}, "CPSFTTrainer", IMAGE_ROWS_WHY, IMAGE_ROWS_INSTEAD)
        if eval_dataset is not None and not isinstance(eval_dataset, str) and not self._skip_prepare_dataset:
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing

            def prepare(ds, name):
                return self._prepare_dataset(ds, self.processing_class, self.args, packing, self._formatting_func, name)

            if isinstance(eval_dataset, dict):
                eval_dataset = {name: prepare(ds, name) for name, ds in eval_dataset.items()}
            else:
                eval_dataset = prepare(eval_dataset, metric_key_prefix)
        return CPTrainer.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)
