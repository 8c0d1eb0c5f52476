"""Test harness for hf_cp's trainer exactness checks: the tiny model and data (models), scripted
balancers, the distributed job (job) and what it records (capture), the single-process reference
built without hf_cp's data path (reference), and the per-step comparison (check).

Test code: nothing under hf_cp/ imports it (tests/test_trainer_exactness.py checks that).
"""
