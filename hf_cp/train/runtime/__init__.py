"""What every trainer composes: the step runtime (step_runtime.py: process groups, planning
ahead or now, the executor, the plan agreement, the engine's backward) and the checkpoint hooks
(checkpoints.py: the resume point, the atomic save, what a failed save raises)."""
