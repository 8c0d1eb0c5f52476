"""`hf-cp preprocess`: tokenise a dataset for CP training and report what its lengths cost."""

from __future__ import annotations

import json
from pathlib import Path

from hf_cp.cli.formatting import HelpFormatter
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask_column


def add_parser(sub) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenise text, chat or prompt-completion samples into input_ids/labels/length and report the lengths",
        description="Read samples (a local .json/.jsonl/.parquet/.csv file, a folder saved with save_to_disk, or a "
        "Hugging Face Hub dataset name when a network is available), tokenise them - chat samples "
        "(messages) through the tokenizer's chat template, prompt-completion samples (TRL's format) as TRL's "
        "SFTTrainer does, chat samples with images and video (--processor) through the model's Qwen2-VL processor - with SFT labels (-100 on masked prompt tokens, aligned "
        "with input_ids, not shifted), apply the over-long policy, save the dataset with save_to_disk "
        "and print a length report: percentiles, a histogram, and the share of tokens and of predicted "
        "attention time per length bucket. The output feeds `hf-cp plan --lengths OUT` and the trainer.",
        epilog="example: hf-cp preprocess hf_cp/data/chat_sample.jsonl --tokenizer outputs/smollm2-135m-instruct "
        "--out outputs/smollm2-chat --max-length 1024 --overlong truncate --plot lengths.png",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "input",
        help="a .json/.jsonl/.parquet/.csv file (optionally .gz), a saved dataset folder, or a Hub dataset name",
    )
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--tokenizer",
        help="tokenizer: a model folder (e.g. from scripts/convert_smollm2.py), a Hub name, or a .gguf file",
    )
    who.add_argument(
        "--processor",
        help="chat samples with images and video: a Qwen2-VL-family processor folder (the model's own: "
        "tokenizer, chat template, image and video processor settings; scripts/make_tiny_vlm_processor.py writes a "
        "tiny one). Writes pixel_values/image_grid_thw and pixel_values_videos/video_grid_thw/second_per_grid_ts "
        "per sample; lengths count the placeholder tokens, which are never trained",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run tokeniser code shipped with the --tokenizer folder or Hub repo (off by default)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output folder for save_to_disk (columns input_ids, labels, length; attn_mask with --group-answers)",
    )
    p.add_argument(
        "--text-field",
        help="plain-text samples: the column holding the text (default: chat samples when "
        "the --messages-field column exists, else the 'text' column)",
    )
    p.add_argument(
        "--messages-field",
        default="messages",
        help="chat samples: the column holding a list of {role, content} messages (a JSON string in CSV)",
    )
    p.add_argument(
        "--prompt-field",
        default="prompt",
        help="the prompt column (a string, or a list of messages): of prompt-completion samples (TRL's format, "
        "used when there is no --messages-field column), and with --group-answers of the grouped records",
    )
    p.add_argument("--completion-field", default="completion", help="prompt-completion samples: the completion column")
    p.add_argument(
        "--mask",
        default="auto",
        choices=("auto", "assistant", "last-assistant", "completion", "none"),
        help="which tokens get labels -100: 'assistant' trains every assistant turn of a chat (prompt, "
        "system and user tokens masked), 'last-assistant' only the final turn, 'completion' only the completion "
        "of a prompt-completion sample (tokenised as TRL's SFTTrainer does), 'none' trains every token; 'auto' is "
        "'assistant' for chat, 'completion' for prompt-completion and 'none' for text; with --group-answers "
        "only the answers are trained ('none' then trains the prompt too, counted once)",
    )
    v = p.add_argument_group(
        "images and video (with --processor)",
        "message content as a list of parts: {type: text, text}, {type: image, image: PATH|PIL}, {type: video, "
        "video: [FRAME PATHS], fps}; a part without its media takes the next one of the sample's images/videos "
        "column (datasets' Image feature). Video files and datasets' Video feature are refused (no decoder is "
        "installed): give clips as frames",
    )
    v.add_argument("--images-field", default="images", help="the column of each sample's images, in part order")
    v.add_argument("--videos-field", default="videos", help="the column of each sample's clips (lists of frames)")
    v.add_argument("--video-fps", type=float, default=2.0, help="frame rate of a clip whose part gives no fps")
    p.add_argument(
        "--lengths-jsonl",
        metavar="OUT.jsonl",
        help='also write one {"length": N} per sample, with "vision": [[t, h, w], ...] for --processor data '
        "(the patch grids of its images, then clips): what `hf-cp plan --lengths` reads",
    )
    p.add_argument("--no-eos", action="store_true", help="text samples: do not append the tokenizer's EOS token")
    g = p.add_argument_group(
        "shared-prompt samples",
        "one prompt and several answers (GRPO/RLOO groups, n samples per prompt, DPO chosen/rejected) as one "
        "sample: [prompt][answer 1]...[answer n], each answer attending to the prompt and itself, positions "
        "continuing from the prompt, labels never crossing answers, the prompt stored and computed once. The "
        "mask goes to the 'attn_mask' column; training (SFT's token cross-entropy: no preference or RL loss) "
        "equals each (prompt, answer) as its own sequence with the prompt's targets counted once",
    )
    g.add_argument(
        "--group-answers",
        action="store_true",
        help="read records {prompt, answers|responses|completions: [...]}, {prompt, chosen, rejected} or "
        "{prompt, completion}; prompt and answers as text or as TRL conversational messages",
    )
    g.add_argument(
        "--answers-field",
        help="with --group-answers: the column holding the list of answers (default: answers, responses or "
        "completions, else chosen + rejected, else completion)",
    )
    g.add_argument(
        "--train-rejected",
        action="store_true",
        help="with --group-answers on chosen/rejected pairs: give rejected answers labels too (default: only "
        "chosen answers are trained; hf_cp's loss is cross-entropy)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        help="longest sample allowed, in tokens; set it to what the largest CP group holds (world x "
        "max tokens per rank). Default: no limit",
    )
    p.add_argument(
        "--overlong",
        default="error",
        choices=("error", "drop", "truncate"),
        help="what to do with samples longer than --max-length: stop with an error naming the sample, drop "
        "them, or cut them to --max-length tokens. The count is always printed",
    )
    p.add_argument("--num-proc", type=int, default=1, help="processes for datasets map/filter")
    p.add_argument("--split", default="train", help="split to read from a dataset with several splits")
    p.add_argument("--subset", help="Hub dataset configuration name")
    p.add_argument("--limit", type=int, help="use only the first N samples")
    p.add_argument(
        "--profile",
        default="h200-qwen2.5-7b",
        help="hardware profile for the attention-cost shares: a profile name (configs/profiles/ here, then built in) or a YAML file",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model dimensions for the cost shares: a model name (configs/models/ here, then built in), a "
        "config.json, or a model folder (default: the config.json beside --tokenizer, or the GGUF's own config; "
        "qwen2.5-7b when there is none)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="also draw the length report as a PNG")
    p.add_argument("--report-json", metavar="OUT.json", help="also write the length report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from hf_cp.data_prep import length_report, load_tokenizer, preprocess  # transformers, datasets
    from hf_cp.data_prep.length_report import display_name, plot_length_report, write_lengths_jsonl  # matplotlib
    from hf_cp.data_prep.model_dims import report_model_dims  # transformers (model configs)
    from hf_cp.data_prep.vision_processor import load_vision_processor  # transformers

    # fail on a bad name before the slow part
    dims, model_name = report_model_dims(args.model, args.tokenizer or args.processor)
    cost = CostModel(dims, HardwareProfile.load(args.profile))
    if args.num_proc < 1:
        raise ValueError(f"--num-proc must be at least 1, got {args.num_proc}")
    processor = tokenizer = None
    if args.processor:
        processor = load_vision_processor(args.processor, trust_remote_code=args.trust_remote_code)
    else:
        tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    res = preprocess(
        args.input,
        tokenizer,
        args.out,
        text_field=args.text_field,
        messages_field=args.messages_field,
        prompt_field=args.prompt_field,
        completion_field=args.completion_field,
        mask=args.mask,
        max_length=args.max_length,
        overlong=args.overlong,
        num_proc=args.num_proc,
        split=args.split,
        subset=args.subset,
        limit=args.limit,
        add_eos=not args.no_eos,
        group_answers=args.group_answers,
        answers_field=args.answers_field,
        train_rejected=args.train_rejected,
        processor=processor,
        images_field=args.images_field,
        videos_field=args.videos_field,
        fps=args.video_fps,
    )
    print(f"hf-cp preprocess: {args.input} -> {args.out}")
    for line in res.summary_lines(args.max_length, args.overlong):
        print("  " + line)
    masks = (
        decode_mask_column(res.dataset[MASK_COLUMN], res.dataset["length"], str(args.out))
        if MASK_COLUMN in res.dataset.column_names
        else None
    )
    rep = length_report(
        res.dataset["length"],
        cost,
        trained_tokens=res.trained_tokens,
        model=model_name,
        profile=str(args.profile),
        masks=masks,
        vision_tokens=res.vision_tokens,
    )
    print(rep.text())
    if args.lengths_jsonl:
        write_lengths_jsonl(args.lengths_jsonl, res.dataset["length"], res.vision_grids)
        print(
            f"wrote per-sample lengths{' and vision grids' if res.vision_grids is not None else ''} to {args.lengths_jsonl}"
        )
    if args.report_json:
        Path(args.report_json).write_text(
            json.dumps(
                dict(
                    rep.to_dict(), overlong=res.overlong, dropped_overlong=res.dropped_overlong, truncated=res.truncated
                ),
                indent=1,
            )
        )
        print(f"wrote the length report to {args.report_json}")
    if args.plot:
        title = f"{display_name(args.input)}: {rep.samples} samples, {rep.tokens} tokens"
        plot_length_report(rep, args.plot, title=title)
        print(f"wrote the length plot to {args.plot}")
    return 0
