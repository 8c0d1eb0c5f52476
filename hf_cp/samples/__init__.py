"""Samples as plain data, torch-free: lengths and how a step's batch is cut from them, attention
masks as slices (and their exact pair counts), the dataset's mask column, each token's target
and position under its mask, pre-packed rows unpacked into documents, and what `hf-cp plan`
reads (`plan_inputs`). The lowest layer of the planning half: it imports no other part of hf_cp."""
