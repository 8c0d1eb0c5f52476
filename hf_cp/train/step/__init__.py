"""One step's execution: the waves (executor.py), rank agreement (agreement.py), CP process
groups (groups.py), the chunked LM-head loss (loss.py), ChunkFlow's chunks (chunkflow.py), the
sequence-objective seam (sequence_objective.py), planned evaluation (evaluation.py), per-layer
compile (layer_compile.py), GC (gc_schedule.py)."""
