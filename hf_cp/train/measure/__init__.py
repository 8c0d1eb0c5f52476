"""What a step measured: the typed step record and its history file (step_record.py), built by
record_builder.py; logged aggregates (metrics.py), the Trainer's own numbers corrected
(trainer_numbers.py), non-finite gradient norms (gradient_norm.py) and refits of the cost
model during the run (online_calibration.py)."""
