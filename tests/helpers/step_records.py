"""CPTrainer step records of a made-up run, for the metrics and report tests."""

from hf_cp.train.measure.step_record import StepRecord


def records(world: int, steps: int = 4, straggler: int = 5):
    """Rank `straggler` is 40 ms slower than the others on every step."""
    out = []
    for k in range(steps):
        pred = [100.0 + r % 3 + k for r in range(world)]
        meas = [p + (40.0 if r == straggler else 0.0) for r, p in enumerate(pred)]
        out.append(
            StepRecord(
                index=k,
                epoch=0,
                global_step=k + 1,
                num_samples=10,
                global_tokens=1000,
                global_valid_tokens=900,
                loss=2.0,
                measured_ms=meas,
                rank_tokens=[10] * world,
                step_wall_ms=max(meas),
                predicted_ms=pred,
                predicted_step_ms=max(pred),
                waves=1,
                plan_digest="d",
            )
        )
    return out
