"""`hf-cp report RUN_DIR`: draw a training run's balance metrics into PNGs."""

from __future__ import annotations

from pathlib import Path

from hf_cp.cli.formatting import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="draw per-step predicted vs measured rank times, imbalance and CP-size use of a training run",
        description="Read the CP metrics of a training run (the trainer's output_dir: cp_history/rank*.jsonl per "
        "step, else trainer_state.json log_history, else TensorBoard events) and write rank_times.png "
        "(predicted vs measured per-rank time per step), imbalance.png (max/mean rank time, step "
        "time), cp_sizes.png (samples per CP group size per step) and loss.png (training loss, and "
        "evaluation losses from trainer_state.json when the run evaluated).",
        epilog="example: hf-cp report outputs/smollm2-cpu --out outputs/smollm2-cpu/report",
        formatter_class=HelpFormatter,
    )
    p.add_argument("run_dir", help="the training run's output directory")
    p.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/report)")
    p.add_argument(
        "--source",
        default="auto",
        choices=("auto", "history", "trainer-state", "tensorboard"),
        help="which logs to read; auto takes the first found in the order history, trainer-state, tensorboard",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from hf_cp.report.runs import RunLogError, read_run, summary_lines, write_report  # matplotlib
    from hf_cp.report.samples import audit_lines, audit_samples  # matplotlib (via report)

    try:
        series = read_run(args.run_dir, args.source)
    except RunLogError as e:
        raise ValueError(str(e)) from None
    print(f"hf-cp report: {args.run_dir}")
    for line in summary_lines(series):
        print("  " + line)
    audit = audit_samples(args.run_dir)  # from the per-rank histories, whatever the metrics source
    for line in audit_lines(audit) if audit is not None else []:
        print("  " + line)
    for path in write_report(series, Path(args.out) if args.out else Path(args.run_dir) / "report"):
        print(f"wrote {path}")
    return 0
