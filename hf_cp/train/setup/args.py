"""CPTrainingArguments: the Trainer's arguments plus what planning a step needs."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Callable, ClassVar, List, Optional, Union

import torch
from transformers import TrainingArguments

from hf_cp.attention.kernels import KERNEL_CHOICES, check_kernel_choice
from hf_cp.planning.setup import PlanningSettings
from hf_cp.readers import load_yaml
from hf_cp.resources import input_path
from hf_cp.train.checks.setup import check_parallelism
from hf_cp.train.step.layer_compile import compile_problem
from hf_cp.train.step.loss import liger_loss_problem

_DEFAULT = PlanningSettings.default  # one set of planning defaults for the trainer, dry run and CLI


@dataclass
class CPTrainingArguments(TrainingArguments):
    """`TrainingArguments` for `CPTrainer`.

    One item of the training data loader is one optimizer step: a global batch of whole samples
    of at most `cp_tokens_per_step` tokens (all ranks together), planned by `cp_balancer` into
    waves of CP groups. The Trainer's batch size and gradient accumulation therefore stay at 1;
    the plan decides how many micro-batches (waves) each step has.
    """

    # one loader item is one planned step; a trainer whose loader yields other batches (CPGRPOTrainer:
    # TRL's prompt batches, each generation batch then planned as one step) turns the check off
    cp_loader_items_are_steps: ClassVar[bool] = True

    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "must stay 1: one loader item is one whole planned step"}
    )
    cp_balancer: str = field(default=_DEFAULT("balancer"), metadata={"help": "balancer name (hf_cp.balance registry)"})
    # dict | str: a mapping in Python and YAML configs, a JSON/YAML string on a command line
    # (HfArgumentParser parses these fields as str), read in __post_init__
    cp_balancer_options: Union[dict, str, None] = field(
        default=None,
        metadata={
            "help": "keyword options of cp_balancer, e.g. {'outlier_fraction': 0.05}; unknown keys are errors "
            "(`hf-cp plan --list-balancer-options` lists them)"
        },
    )
    cp_profile: Union[dict, str, None] = field(
        default=_DEFAULT("profile"),
        metadata={
            "help": "hardware profile: a profile name (configs/profiles/ here, then built in), a YAML path, or a dict "
            "of its fields"
        },
    )
    cp_model_dims: Optional[str] = field(
        default=None, metadata={"help": "model dimensions for the cost model (default: the model's own config)"}
    )
    cp_max_tokens_per_rank: Union[int, str] = field(
        default=_DEFAULT("max_tokens_per_rank"),
        metadata={
            "help": "memory cap per rank per micro-batch, in tokens; auto: the most that fit the device's memory by "
            "the memory model (said at set-up)"
        },
    )
    cp_tokens_per_step: Optional[int] = field(
        default=None,
        metadata={
            "help": "tokens of one global batch, all ranks together (default: cp_tokens_per_rank_per_step x world)"
        },
    )
    cp_tokens_per_rank_per_step: int = field(
        default=_DEFAULT("tokens_per_rank_per_step"), metadata={"help": "used when cp_tokens_per_step is unset"}
    )
    cp_chunk_size: Optional[int] = field(
        default=_DEFAULT("chunk_size"),
        metadata={
            "help": "ChunkFlow (balancer chunkflow, or auto's chunkflow member): most tokens of a dependent chunk of a "
            "long sample (default: cp_max_tokens_per_rank / cp_chunk_keep)"
        },
    )
    cp_chunk_keep: int = field(
        default=_DEFAULT("chunk_keep"),
        metadata={
            "help": "ChunkFlow: K, dependent chunks whose activations are kept; the first N-K are recomputed in "
            "backward (memory: K x chunk size activations plus the sample's K/V)"
        },
    )
    cp_max_group_size: Optional[int] = field(default=None, metadata={"help": "largest CP group (default: world)"})
    cp_gpus_per_node: Optional[int] = field(default=None, metadata={"help": "ranks per node (default: profile's)"})
    cp_plan_lookahead: int = field(
        default=2,
        metadata={"help": "steps planned ahead of training (in the planner worker); 0 plans each step inline"},
    )
    cp_plan_in_subprocess: bool = field(
        default=True,
        metadata={
            "help": "plan ahead in a forked worker process rather than a thread: a planner thread holds the GIL "
            "against the training thread's kernel launches (10-15x slower op dispatch measured by "
            "scripts/bench_planner_gil.py)"
        },
    )
    cp_plan_workers: int = field(
        default=1,
        metadata={
            "help": "planner worker processes (with cp_plan_in_subprocess): steps are planned independently, so up to "
            "this many of the cp_plan_lookahead steps are planned at once; raise it when one plan takes longer "
            "than one training step (the auto balancer at hundreds of ranks)"
        },
    )
    cp_shuffle: bool = field(
        default=_DEFAULT("shuffle"), metadata={"help": "shuffle the epoch order (seeded by `seed`)"}
    )
    cp_compare_balancer: Optional[str] = field(
        default=_DEFAULT("compare_balancer"),
        metadata={"help": "also plan every step with this balancer (not run) to report what it would have cost"},
    )
    cp_compare_measured: bool = field(
        default=False,
        metadata={
            "help": "run cp_compare_balancer's plan on every other step (the odd ones) instead of only predicting "
            "it, so that both balancers are measured in one run, under the same load; a step's loss and gradients "
            "are the same whichever plan runs it, and the end-of-run summary compares their measured step times"
        },
    )
    cp_loss_chunk_tokens: int = field(
        default=2048,
        metadata={
            "help": "tokens per chunk of the LM-head cross-entropy (logits recomputed in backward, never all "
            "materialised); 0 computes all logits at once"
        },
    )
    cp_gc_interval_steps: int = field(
        default=0,
        metadata={
            "help": "collect garbage on every rank at the end of every N-th step, with automatic collection off "
            "during training, so collector pauses do not make random ranks stragglers; 0 leaves Python's "
            "collector alone"
        },
    )
    cp_allow_schedule_change: bool = field(
        default=False,
        metadata={
            "help": "resume a checkpoint even when the sample schedule (data, seed, tokens per step) differs from "
            "the one it was trained on; the interrupted epoch then skips and repeats samples"
        },
    )
    cp_break_lock: bool = field(
        default=False,
        metadata={
            "help": "take output_dir's lock (hf_cp_run.lock) even when another run seems to hold it: for a lock left "
            "by a run that is gone on another host, whose process this host cannot see (a dead process of this "
            "host is taken over anyway). Two live runs on one output_dir overwrite each other's checkpoints"
        },
    )
    cp_checkpoint_allowed_globals: List[str] = field(
        default_factory=list,
        metadata={
            "help": "globals (module.name) a resumed checkpoint's pickles may import beyond what the Trainer's, "
            "DeepSpeed's and torch distributed checkpoint's states need; a checkpoint importing anything else is "
            "refused before loading, since unpickling it would run code. Name only globals of checkpoints you trust"
        },
    )
    cp_stop_on_nonfinite_grad: bool = field(
        default=True,
        metadata={
            "help": "stop, naming the step and its samples, when a step's gradient norm is NaN or infinite (DeepSpeed "
            "would skip the update, silently leaving the step's samples unlearned); false: warn and go on"
        },
    )
    cp_calibrate: bool = field(
        default=True,
        metadata={
            "help": "fit the cost model to the measured per-rank compute and step wall time during training and plan "
            "later steps with it (the same coefficients on every rank, from rank 0 through the plan agreement); "
            "a plan's exactness does not depend on them, only its speed. Off under full_determinism (plans would "
            "depend on timings). CPTrainer and its SFT/DPO/KTO trainers; the GRPO/RLOO trainers do not calibrate"
        },
    )
    cp_calibrate_min_steps: int = field(default=8, metadata={"help": "steps observed before the first calibration"})
    cp_calibrate_scale_after: int = field(
        default=0,
        metadata={
            "help": "steps after which, before the first calibration, the profile's CPU work (compute, the cost per "
            "gradient reduction and per step) is scaled by one factor, the median measured / predicted per-rank "
            "compute of these steps (the first left out when N > 1: start-up), so that a profile of another machine "
            "is right from the next planned step; the shipped CPU configs set 2. 0 (or at least "
            "cp_calibrate_min_steps, whose fit comes first): off"
        },
    )
    cp_calibrate_every: int = field(
        default=4,
        metadata={
            "help": "steps between calibrations (each fits the latest 16 steps, or cp_calibrate_min_steps if more)"
        },
    )
    cp_save_final_model: bool = field(
        default=True,
        metadata={
            "help": "hf-cp train saves the final model (and the tokenizer, when the run has one) to "
            "output_dir/final when training ends, whatever save_strategy says about checkpoints"
        },
    )
    cp_log_all_metrics: bool = field(
        default=False,
        metadata={
            "help": "print every cp/ metric in each log line (default: a handful; all of them go to the log history "
            "in trainer_state.json and to the trackers either way)"
        },
    )
    cp_record_history: bool = field(
        default=True, metadata={"help": "append one JSON line per step and rank to output_dir/cp_history/rank<R>.jsonl"}
    )
    cp_attention_kernel: str = field(
        default="auto",
        metadata={
            "help": f"the local attention kernel, one of {', '.join(KERNEL_CHOICES)}. auto: on CUDA flash-attn 2 when "
            "installed, else flash-attn-4 on Hopper and later, else torch's varlen_attn; on CPU aten's flash "
            "attention. A kernel that is not installed or not for the run's device is refused by name; fp32 "
            "tensors on CUDA run the math kernel whatever the choice (the flash kernels run fp16/bf16 only)"
        },
    )
    cp_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile every decoder layer before training, hf_cp's attention left out of the graphs "
            "(hf_cp/train/step/layer_compile.py); refused with ChunkFlow (cp_balancer chunkflow, or auto with chunkflow "
            "among its members)"
        },
    )

    def __post_init__(self):
        # accelerate's CP and DeepSpeed's SP would split the sequences hf_cp plans: refused by name
        # here (and in the dry run), not as a bare assertion inside DeepSpeed
        check_parallelism(self.parallelism_config)
        if isinstance(self.deepspeed, str):
            # a shipped recipe (recipes/ds-zero2-gpu.json) is found from any directory (hf_cp.resources)
            self.deepspeed = str(input_path(self.deepspeed))
        ds_env = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if ds_env and ds_env != "none":
            # so is an accelerate config's deepspeed_config_file (`hf-cp recipe cpu-2proc-zero2` from
            # a wheel): accelerate reads it relative to the working directory when training.deepspeed is unset
            os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(input_path(ds_env))
        super().__post_init__()
        for name in ("cp_balancer_options", "cp_profile"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):  # a mapping given on a command line
                parsed = load_yaml(value)  # hf_cp's reader: no duplicate keys or alias bombs
                if not isinstance(parsed, dict):
                    raise ValueError(f"CPTrainingArguments: {name} {value!r} is not a mapping")
                setattr(self, name, parsed)
        if isinstance(self.cp_compare_balancer, str) and self.cp_compare_balancer.lower() in ("", "none", "null"):
            self.cp_compare_balancer = None  # as `hf-cp plan --compare-balancer none`: a command-line flag's None
        if self.cp_compare_measured and (not self.cp_compare_balancer or self.cp_compare_balancer == self.cp_balancer):
            raise ValueError(
                f"CPTrainingArguments: cp_compare_measured runs cp_compare_balancer's plan on every other step; "
                f"set cp_compare_balancer to a balancer other than cp_balancer {self.cp_balancer!r} "
                f"(it is {self.cp_compare_balancer!r})"
            )
        # the kind of device the run trains on, for the choices that depend on it (before the
        # Trainer sets up its device: TrainingArguments.device would start the distributed state)
        device = torch.device("cuda" if torch.cuda.is_available() and not self.use_cpu else "cpu")
        if getattr(self, "use_liger_kernel", False):
            # Liger patches the model's LM head and loss; CPTrainer computes the loss itself (over the
            # LM head, over a plan's shards): on CUDA with Liger's fused linear cross-entropy
            # (loss.liger_lm_head_loss), elsewhere the patch would be bypassed without a word
            problem = liger_loss_problem(device.type, self.cp_loss_chunk_tokens)
            if problem:
                raise ValueError(f"CPTrainingArguments: {problem}")
        try:
            check_kernel_choice(self.cp_attention_kernel, device)
        except ValueError as e:
            raise ValueError(f"CPTrainingArguments: {e}") from None
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"CPTrainingArguments: gradient_accumulation_steps is {self.gradient_accumulation_steps}; "
                f"CPTrainer accumulates over the waves of each planned step, size steps with "
                f"cp_tokens_per_step instead and keep gradient_accumulation_steps=1"
            )
        if self.cp_loader_items_are_steps and self.per_device_train_batch_size != 1:
            raise ValueError(
                f"CPTrainingArguments: per_device_train_batch_size is {self.per_device_train_batch_size}; "
                f"one loader item is one whole planned step, so it must be 1 (use cp_tokens_per_step)"
            )
        try:  # the planning settings check themselves (the same checks serve `hf-cp plan`)
            self.planning_settings()
        except ValueError as e:
            raise ValueError(f"CPTrainingArguments: cp_{e}") from None
        if self.cp_loss_chunk_tokens < 0:
            raise ValueError(
                f"CPTrainingArguments: cp_loss_chunk_tokens must be >= 0 (0: full logits), got "
                f"{self.cp_loss_chunk_tokens}"
            )
        if self.cp_gc_interval_steps < 0:
            raise ValueError(
                f"CPTrainingArguments: cp_gc_interval_steps must be >= 0 (0: off), got {self.cp_gc_interval_steps}"
            )
        if self.cp_plan_workers < 1:
            raise ValueError(f"CPTrainingArguments: cp_plan_workers must be >= 1, got {self.cp_plan_workers}")
        if self.cp_calibrate_min_steps < 1 or self.cp_calibrate_every < 1:
            raise ValueError(
                f"CPTrainingArguments: cp_calibrate_min_steps and cp_calibrate_every must be >= 1, got "
                f"{self.cp_calibrate_min_steps} and {self.cp_calibrate_every}"
            )
        if self.cp_calibrate_scale_after < 0:
            raise ValueError(
                f"CPTrainingArguments: cp_calibrate_scale_after must be >= 0 (0: off), got {self.cp_calibrate_scale_after}"
            )
        if self.cp_plan_lookahead < 0:
            raise ValueError(f"CPTrainingArguments: cp_plan_lookahead must be >= 0, got {self.cp_plan_lookahead}")
        if self.cp_compile:
            problem = compile_problem(self.planning_settings())
            if problem:
                raise ValueError(f"CPTrainingArguments: {problem}")
        # the loader yields planned steps, not model inputs: keep every dataset column
        self.remove_unused_columns = False

    def planning_settings(self) -> PlanningSettings:
        return PlanningSettings.from_training_args(self)

    def tokens_per_step(self, world_size: int) -> int:
        return self.planning_settings().step_tokens(world_size)


def keep_defaults_of(base) -> Callable[[type], type]:
    """Class decorator, under @dataclass, of a config mixing CPTrainingArguments with a TRL config
    (`base`): the TRL config's own defaults (DPOConfig's learning_rate 1e-6, logging_steps 10,
    gradient_checkpointing True, ...) are kept. Without it, CPTrainingArguments' fields, which are
    TrainingArguments' with their defaults, come later in the dataclass merge and would silently
    replace them. Fields CPTrainingArguments or the class itself declares keep their own."""

    def apply(cls: type) -> type:
        own = set(CPTrainingArguments.__dict__.get("__annotations__", {})) | set(
            cls.__dict__.get("__annotations__", {})
        )
        ours = {f.name: f for f in fields(CPTrainingArguments)}
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for f in fields(base):
            mine = ours.get(f.name)
            if f.name in own or mine is None or not f.init:
                continue
            if f.default is MISSING and f.default_factory is MISSING:
                continue
            same = f.default == mine.default and f.default_factory == mine.default_factory
            if same:
                continue
            annotations[f.name] = f.type
            kept = dict(default=f.default) if f.default is not MISSING else dict(default_factory=f.default_factory)
            setattr(cls, f.name, field(metadata=f.metadata, **kept))
        cls.__annotations__ = annotations
        return cls

    return apply
