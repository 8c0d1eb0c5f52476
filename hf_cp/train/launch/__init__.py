"""Entry points: `python -m hf_cp.train CONFIG` (entry.py) and `hf-cp train --dry-run` (dry_run.py)."""
