"""Checkpoints and restarts: where a run resumes from (resolve.py), the sample schedule it was
trained on (schedule.py), completion marks and rotation (marks.py), what a failed save raises
(save_errors.py), the files checked before loading (integrity.py, trust.py), whether the model
and engine fit (fit.py), output_dir's lock (run_lock.py) and the stop signal (stop_signal.py)."""
