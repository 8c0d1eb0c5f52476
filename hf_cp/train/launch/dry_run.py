"""`hf-cp train CONFIG --dry-run`: every check a training launch would make, without launching.

A bad setting found by N processes after model loading costs a queue wait and N GPU-minutes;
here it costs seconds on a login node. The dry run reads the config, the model's config (not its
weights) and the data, builds the same cost model, cluster and sampler as CPTrainer
(planning_setup), plans and validates the first steps and the evaluation set for the target
world size, and checks what a resume would find in output_dir (which checkpoint it takes,
partial checkpoints of an interrupted save, the sample schedule, a ZeRO checkpoint of another
world size, another run's lock: an `error:` line) and what a restart would need. It raises
the error training would raise, or returns a short report.

A TRL trainer (`trainer: dpo | sft | kto | grpo | rloo`) gets the same launch-setting and
output_dir checks (one set of helpers for both), and of its data what holds before TRL
tokenises the rows: token ids in the vocabulary where rows carry them, no empty DPO/KTO answer.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional

import torch

from hf_cp.attention.interface import ATTN_IMPLEMENTATION as HF_CP_ATTENTION
from hf_cp.cost.dims import VisionDims, has_vision_tower
from hf_cp.planning.evaluation import plan_evaluation
from hf_cp.planning.profile_check import profile_warning
from hf_cp.planning.setup import AUTO_CAP, engine_memory, engine_memory_lines, planning_setup
from hf_cp.planning.worker import Planner
from hf_cp.train.checkpoint.fit import check_checkpoint_fits, run_engine
from hf_cp.train.checkpoint.marks import checkpoint_status, legacy_note, scan_checkpoints
from hf_cp.train.checkpoint.resolve import LATEST, check_resume, resolve_resume, restart_problems
from hf_cp.train.checkpoint.run_lock import lock_status
from hf_cp.train.checkpoint.schedule import schedule_record
from hf_cp.train.checks.answers import EMPTY_ANSWER_CHECKS, refuse_empty_answers
from hf_cp.train.checks.launch import check_launch_settings
from hf_cp.train.checks.model import check_model_config_supported, check_recurrent_layers_fit
from hf_cp.train.checks.setup import SetupError, check_attention
from hf_cp.train.data.columns import check_token_ids, eos_token_ids, model_vocab_size, read_token_columns
from hf_cp.train.launch.trainers import TRAINERS, check_columns, reward_functions
from hf_cp.train.setup.config import (
    DataPreparation,
    apply_template,
    load_config,
    load_datasets,
    load_run_tokenizer,
    model_class,
    model_config,
    training_arguments,
)
from hf_cp.train.setup.data_section import CACHE_FOLDER
from hf_cp.train.setup.peft_section import adapter_line, wrap_model
from hf_cp.train.setup.sharding import check_sharding, sharding_of
from hf_cp.train.setup.trainer_setup import device_memory_gb, planning_vision_grids
from hf_cp.train.step.router_balance import router_balance_of


def login_node_arguments(cfg: dict, config_class=None):
    """(the training arguments, the launch's precision {"bf16", "fp16"}, the device it trains on)
    of a config, built in fp32 on the CPU: precision and device do not change what is checked or
    planned, and a login node has no GPU to validate bf16 with."""
    tcfg = dict(cfg.get("training") or {})
    device = "cpu" if tcfg.get("use_cpu") else "cuda"  # where the run will train
    precision = {"bf16": bool(tcfg.get("bf16")), "fp16": bool(tcfg.get("fp16"))}  # the launch's
    tcfg.update(bf16=False, fp16=False, use_cpu=True)
    return training_arguments(tcfg, cfg["_source"], config_class), precision, device


def launch_settings_warnings(args, world_size: int, src: str, precision: dict) -> List[str]:
    """What every trainer checks when it is built (CPTrainer, PlannedRollouts): the engines, the
    DeepSpeed JSON at the launch's world size and precision, ddp_timeout, output_dir, report_to.
    Raises the launch's refusal; returns its warnings as report lines."""
    check_sharding(args)
    return [f"warning: {w}" for w in check_launch_settings(args, world_size, src, precision)]


def output_dir_lines(
    args, world_size: int, hf_config, schedule: Optional[Callable[[], dict]] = None, max_restarts: int = 0
) -> List[str]:
    """What a launch would find in output_dir: another run's lock (an `error:` line), partial
    checkpoints, and the checkpoint a resume takes, checked as a resume checks it (its engine
    and model, its files and pickles, its sample schedule against `schedule()` where the dry
    run can make one, its ZeRO world size); raises what the resume would raise. Then what a
    restart would need (`max_restarts`)."""
    lines = []
    # another run's lock on output_dir (checkpoint/run_lock.py): read, not taken; a launch would be refused
    state = lock_status(args.output_dir, args.cp_break_lock)
    if state is not None:
        lines.append(f"{state[0]}: {state[1]}")
    # a resume takes the newest complete checkpoint: partial ones (a save that was interrupted) are named
    partial = [c for c in scan_checkpoints(args.output_dir) if not c.complete]
    skipped = "a resume or restart skips it" if args.resume_from_checkpoint else "resume_from_checkpoint is off"
    lines += [f"warning: {c.path} is a partial checkpoint ({c.problem}); {skipped}" for c in partial]
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, notes=[])  # reported here
    if resume is not None:
        ds = getattr(args, "hf_deepspeed_config", None)
        ds_config = ds.config if ds is not None else None
        check_checkpoint_fits(resume, run_engine(sharding_of(args), ds_config), hf_config)
        notes = check_resume(
            resume,
            schedule() if schedule is not None else None,
            world_size,
            ds_config,
            args.cp_allow_schedule_change,
            args.cp_checkpoint_allowed_globals,
        )
        status = checkpoint_status(resume)
        setting = args.resume_from_checkpoint
        latest = setting is True or (isinstance(setting, str) and setting.lower() in LATEST)
        fits = (
            "engine, model and ZeRO world size"
            if schedule is None
            else "engine, model, sample schedule and ZeRO world size"
        )
        lines.append(
            f"resume: a launch or restart resumes from {resume}"
            + (" (the newest complete checkpoint)" if partial and latest else "")
            + f": its files match their checksums, its pickles import no code, and its {fits} fit this run"
            + (
                "; its sample schedule is not checked here (TRL tokenises the rows when the trainer is built)"
                if schedule is None
                else ""
            )
        )
        lines += [f"note: {note}" for note in ([legacy_note(resume)] if status.legacy else []) + notes]
    elif args.resume_from_checkpoint:
        what = "no complete checkpoint" if partial else "no checkpoint"
        lines.append(f"resume: {what} in {args.output_dir} yet, a fresh start")
    if max_restarts:
        env = dict(os.environ, TORCHELASTIC_MAX_RESTARTS=str(max_restarts))
        lines += [f"warning: {p}" for p in restart_problems(args.save_strategy, args.resume_from_checkpoint, env)]
    return lines


def trl_trainer_dry_run(cfg: dict, world_size: int, max_restarts: int = 0) -> List[str]:
    """What the dry run can check of a TRL trainer's config without building it: the training
    section as its config class takes it, what the trainer refuses of its arguments alone (its
    `cp_check_arguments`, the same function its __init__ calls), the launch settings every trainer
    checks, the model's features, its tokenizer, the data's columns (token ids in the vocabulary
    where the rows carry them, no empty preference answer), the reward functions, and output_dir
    (lock, checkpoints, resume). TRL tokenises the rows when the trainer is built, so the plans are made (and
    checked) from the first step."""
    name, src = cfg["trainer"], cfg["_source"]
    args, precision, _ = login_node_arguments(cfg, TRAINERS.config_class(name))
    try:  # what the trainer refuses of its arguments before it loads anything (max_length, padding_free, ...)
        TRAINERS.trainer_class(name).cp_check_arguments(args)
    except ValueError as e:
        raise ValueError(f"{src}: trainer: {name}: {e}") from None
    warnings = launch_settings_warnings(args, world_size, src, precision)
    mcfg = cfg.get("model") or {}
    hf_config = model_config(mcfg, src)
    meta_model = check_model_config_supported(hf_config, f"{src}: the model", model_class(mcfg, src))
    if router_balance_of(meta_model) is not None and name != "sft":  # CPSFTTrainer computes it as CPTrainer does
        raise SetupError(
            f"{src}: trainer: {name} does not compute the MoE router's auxiliary loss (output_router_logits=True with "
            "router_aux_loss_coef != 0); set output_router_logits=False, or train with trainer: cp or sft"
        )
    tokenizer = load_run_tokenizer(mcfg, src)
    if tokenizer is None:
        raise ValueError(f"{src}: trainer: {name} tokenises text: give model.tokenizer or a pretrained folder with one")
    apply_template(cfg.get("data") or {}, tokenizer, src)
    train, evaluation = load_datasets(cfg.get("data") or {}, src, DataPreparation(name, tokenizer))
    check_rows = getattr(TRAINERS.trainer_class(name), "cp_check_datasets", None)
    if check_rows is not None:  # what the trainer refuses of its rows before TRL prepares them (raw images)
        try:
            check_rows(train, evaluation)
        except ValueError as e:
            raise ValueError(f"{src}: trainer: {name}: {e}") from None
    check_columns(name, train, src)
    vocab = model_vocab_size(meta_model, hf_config)
    # the adapter TRL wraps the policy with (peft_config): target_modules must name modules of the model
    adapter = [adapter_line(wrap_model(meta_model, cfg), cfg)] if cfg.get("peft") else []
    for data, data_name in ((train, "train_dataset"), (evaluation, "eval_dataset")):
        if data is None:
            continue
        if "input_ids" in data.column_names:  # tokenised rows TRL passes through: ids outside fail the embedding
            check_token_ids(data, data_name, vocab)
        if name in EMPTY_ANSWER_CHECKS:  # what CPDPOTrainer / CPKTOTrainer refuse before TRL tokenises
            refuse_empty_answers(data, data_name, *EMPTY_ANSWER_CHECKS[name])
    if cfg.get("reward"):
        reward_functions(cfg["reward"]["functions"], src)
    lines = [
        f"config {Path(src).name}: trainer {name}, {world_size} rank(s), balancer {args.cp_balancer}, {len(train)} "
        f"rows with columns {sorted(train.column_names)}"
        + (f", {len(evaluation)} for evaluation" if evaluation is not None else ""),
        f"the training section, model, tokenizer and data fit trainer: {name}; TRL tokenises the rows when the "
        "trainer is built, so each step's plan is made and checked from the first step",
    ]
    return lines + adapter + warnings + output_dir_lines(args, world_size, hf_config, None, max_restarts)


def dry_run(
    config_path: str,
    overrides: Optional[List[str]] = None,
    world_size: int = 1,
    steps: int = 20,
    max_restarts: int = 0,
    keep_preprocessed: bool = False,
) -> List[str]:
    """Report lines; raises the error the training launch would raise. `keep_preprocessed`: raw
    rows the data section preprocesses are saved under output_dir/preprocessed, where the launch
    reads them back (`hf-cp train --nproc`'s checks before its launch), and what preprocessing did
    is printed at once; else nothing is written and the report lines hold it."""
    cfg = load_config(config_path, overrides, TRAINERS)
    if cfg["trainer"] != "cp":
        return trl_trainer_dry_run(cfg, world_size, max_restarts)
    src = cfg["_source"]
    args, precision, device = login_node_arguments(cfg)
    half_precision = any(precision.values())  # what the run's model states will be
    launch_warnings = launch_settings_warnings(args, world_size, src, precision)
    settings = args.planning_settings()
    if settings.model_states is not None:  # the run's precision, not the login node's
        settings.model_states["half_precision"] = half_precision
    if settings.max_tokens_per_rank == AUTO_CAP and device == "cpu":  # as CPTrainer sizes it on this host
        settings = replace(settings, device_memory_gb=device_memory_gb(torch.device("cpu"), world_size))
    mcfg = cfg.get("model") or {}
    hf_config = model_config(mcfg, src)
    # what CPTrainer refuses when built
    meta_model = check_model_config_supported(hf_config, f"{src}: the model", model_class(mcfg, src))
    router_balance_of(meta_model)  # the MoE router term, refused where inexact (StepRuntime, when built)
    tokenizer = load_run_tokenizer(mcfg, src)  # what the final save would include: it must load
    apply_template(cfg.get("data") or {}, tokenizer, src)
    # raw rows preprocessed as the launch will (in memory: the dry run writes nothing under output_dir)
    preparation_lines: List[str] = []
    cache = Path(args.output_dir) / CACHE_FOLDER if keep_preprocessed else None
    # kept for the launch: its report is the launch's, printed now (the launch reads the copy back)
    say = print if keep_preprocessed else preparation_lines.append
    train, evaluation = load_datasets(cfg.get("data") or {}, src, DataPreparation("cp", tokenizer, cache, say=say))
    vocab = model_vocab_size(meta_model, hf_config)  # ids outside it fail the launch's embedding lookup
    data = read_token_columns(train, "train_dataset", eos_token_ids(tokenizer, hf_config), vocab)
    check_recurrent_layers_fit(
        meta_model, f"{src}: the model", {m.kind for m in data.masks.values()}, settings.balancer
    )
    # as the launch wraps the model (entry.py): target_modules must name modules of the model
    adapter = [adapter_line(wrap_model(meta_model, cfg), cfg)] if cfg.get("peft") else []
    # the images' and clips' grids, priced (time and memory) with the config's tower, as CPTrainer plans them
    config = hf_config.to_dict()
    grids = planning_vision_grids(train, True) if has_vision_tower(config) else {}
    setup = planning_setup(
        settings,
        data.lengths,
        world_size,
        model_config=config,
        num_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        vision=VisionDims.from_hf_config(config, source=f"{src}: the model") if grids else None,
    )
    setup.vision = dict(grids)
    cost, cluster, sampler = setup.cost, setup.cluster, setup.sampler
    # the check CPTrainer makes when it is built
    check_attention(mcfg.get("attn_implementation", HF_CP_ATTENTION), cluster.group_sizes[-1], f"{src}: the model")
    planner = Planner.from_setup(setup, lookahead=0, masks=data.masks)
    attn = mcfg.get("attn_implementation", HF_CP_ATTENTION)
    if data.masks and attn != HF_CP_ATTENTION:
        raise ValueError(
            f"{src}: {len(data.masks)} training samples carry attention masks (e.g. shared-prompt) that only the "
            f"{HF_CP_ATTENTION} attention reads, which needs model.attn_implementation: {HF_CP_ATTENTION} (the "
            f"config sets {attn!r})"
        )
    n = min(steps, len(sampler))
    planned = [planner.get(k) for k in range(n)]  # each validated against the cluster and the heads
    lines = [
        f"config {Path(src).name}: {world_size} rank(s), balancer {planner.balancer_name}, "
        f"{len(data)} training samples, {len(sampler)} steps of {sampler.tokens_per_step} tokens",
        f"longest sample {max(data.lengths)} tokens; a rank holds {cluster.max_tokens_per_rank}, the largest "
        f"CP group ({cluster.group_sizes[-1]} ranks) {cluster.largest_capacity}"
        + (
            f"; {planner.balancer_name} trains samples up to {planner.max_sample_tokens} tokens (dependent chunks "
            f"on one rank)"
            if planner.max_sample_tokens > cluster.largest_capacity
            else ""
        ),
    ]
    if setup.cap_note:  # what cp_max_tokens_per_rank: auto chose
        lines.append(setup.cap_note)
    lines += preparation_lines
    lines += adapter
    chunked = sorted({s for ps in planned for s in ps.plan.chunked_samples})
    if chunked and mcfg.get("attn_implementation", HF_CP_ATTENTION) != HF_CP_ATTENTION:
        raise ValueError(
            f"{src}: the {planner.balancer_name!r} plans run samples {chunked[:10]} as dependent chunks (ChunkFlow), "
            f"whose K/V state store is reached through model.attn_implementation: {HF_CP_ATTENTION}"
        )
    name = settings.profile if isinstance(settings.profile, str) else cost.profile.name
    model_name = settings.model_dims or mcfg.get("pretrained") or mcfg.get("config") or ""
    warning = profile_warning(cost.profile, name, cost.dims, device, str(model_name))
    if warning:
        lines.append(f"warning: {warning}")
    lines += [f"warning: {w}" for w in data.warnings]  # rows that look packed but carry no boundaries
    lines += launch_warnings
    line = (
        f"first {n} step(s) planned and valid: predicted "
        f"{statistics.mean(ps.predicted.makespan_ms for ps in planned):.1f} ms/step "
        f"({'wall time under ' + settings.execution if settings.execution else 'compute'}, the profile as given"
        f"{'; training recalibrates it' if args.cp_calibrate and not args.full_determinism else ''}), per-rank max/mean "
        f"{statistics.mean(ps.predicted.imbalance for ps in planned):.3f}, planner "
        f"{statistics.median(ps.planner_ms for ps in planned):.1f} ms/step"
    )
    compared = [ps.compare.makespan_ms for ps in planned if ps.compare is not None]
    if compared:  # the comparison balancer skips steps with samples longer than it trains
        line += f"; {planner.compare_name} would take {statistics.mean(compared):.1f} ms/step" + (
            f" (on the {len(compared)} steps it can plan)" if len(compared) < len(planned) else ""
        )
    lines.append(line)
    if args.cp_compare_measured:
        lines.append(
            f"cp_compare_measured: training runs {planner.compare_name}'s plan on every other step (the odd ones) "
            f"and {planner.balancer_name}'s on the others; the summary compares their measured step times"
        )
    # what each engine would hold per rank at this cap, and the largest model each fits
    states = settings.model_states or {}
    # the memory cp_max_tokens_per_rank: auto sized the cap from (this host's, on the CPU), else the profile's
    device_memory = settings.device_memory_gb or cost.profile.device_memory_gb
    memory = engine_memory(
        cost.dims,
        cost.profile,
        world_size,
        cluster.max_tokens_per_rank,
        half_precision,
        settings.loss_chunk_tokens,
        int(states.get("param_bytes", 4)),
        device_memory,
    )
    lines += engine_memory_lines(memory, world_size, cluster.max_tokens_per_rank, half_precision, device_memory)
    if evaluation is not None:
        eval_data = read_token_columns(evaluation, "eval_dataset", vocab_size=vocab, training=False)
        plans = plan_evaluation(
            eval_data.lengths,
            eval_data.valid_counts,
            sampler.tokens_per_step,
            setup.balancer(),
            cluster,
            cost,
            args.seed,
            "eval_dataset",
            masks=eval_data.masks,
        )
        lines.append(f"evaluation: {len(evaluation)} samples in {len(plans)} planned batch(es), valid")

    def schedule() -> dict:  # what a resume compares with the checkpoint's; made only for one
        return schedule_record(
            sampler.lengths, sampler.tokens_per_step, sampler.seed, sampler.shuffle, world_size, data.digest()
        )

    return lines + output_dir_lines(args, world_size, hf_config, schedule, max_restarts)
