"""TRL SFT with hf_cp: TRL prepares the data (prompt/completion, messages or text), hf_cp plans
every step (balanced context parallelism) and runs it. The TRL recipe; needs the `trl` extra.

    # 2 CPU processes, DeepSpeed ZeRO-2 over gloo (as configs/tiny-cpu.yaml's main job)
    accelerate launch --config_file recipes/cpu-2proc-zero2.yaml recipes/trl_sft.py \\
        --model_path outputs/smollm2-135m-instruct --dataset_path my_prompt_completion.jsonl \\
        --output_dir outputs/trl-sft --use_cpu --deepspeed recipes/ds-zero2-cpu.json \\
        --cp_max_tokens_per_rank 512 --cp_tokens_per_step 1536 --cp_profile cpu --max_steps 2
    # 8 GPUs
    accelerate launch --config_file recipes/gpu-8x1-zero2.yaml recipes/trl_sft.py \\
        --model_path Qwen/Qwen2.5-0.5B-Instruct --dataset_path trl-lib/Capybara --output_dir outputs/trl-sft \\
        --bf16 --deepspeed recipes/ds-zero2-gpu.json --cp_max_tokens_per_rank 32768 --cp_tokens_per_rank_per_step 65536

From a wheel, `hf-cp recipe` prints the installed files' paths:
    accelerate launch --config_file "$(hf-cp recipe cpu-2proc-zero2)" "$(hf-cp recipe trl_sft)" ...

Every SFTConfig option (TRL) and every cp_* option (hf_cp) is a flag; see docs/coming_from.md for
how TRL's, axolotl's and ALST's knobs map to hf_cp's. The final model and tokenizer are saved
to --output_dir.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ScriptArguments:
    model_path: str = field(
        metadata={"help": "model folder or Hub name (its tokenizer is used unless --tokenizer_path)"}
    )
    dataset_path: str = field(
        metadata={"help": "a .json/.jsonl/.parquet/.csv file, a saved dataset folder, or a Hub dataset name"}
    )
    tokenizer_path: Optional[str] = field(default=None, metadata={"help": "tokenizer folder (default: model_path)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a dataset with several"})
    attn_implementation: str = field(default="hf_cp", metadata={"help": "hf_cp: local, Ulysses and ring attention"})


def main(argv: Optional[List[str]] = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp" with transformers
    from hf_cp.data_prep.inputs import load_input  # datasets
    from hf_cp.train.launch.entry import shutdown_distributed, start_cpu_processes  # torch
    from hf_cp.train.objectives.sft import CPSFTConfig, CPSFTTrainer  # trl

    script, args = HfArgumentParser((ScriptArguments, CPSFTConfig)).parse_args_into_dataclasses(argv)
    start_cpu_processes(bool(args.deepspeed), args.ddp_timeout)  # CPU: gloo, before the Trainer's Accelerator
    model = AutoModelForCausalLM.from_pretrained(script.model_path, attn_implementation=script.attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_path or script.model_path)
    dataset = load_input(script.dataset_path, split=script.dataset_split)
    trainer = CPSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)  # every rank (DeepSpeed gathers); the tokenizer too
    if trainer.cp_rank == 0:
        print(f"\n==== hf_cp + TRL SFT: {trainer.cp_world} process(es), {len(trainer.cp_data)} samples ====")
        for line in trainer.cp_summary():
            print("  " + line)
        print(f"  final model and tokenizer saved to {args.output_dir}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
