"""A step's data: the plan collator (collator.py), answer slots (answer_slots.py), the loader's
planned steps (planned_steps.py), dataset columns (columns.py), streaming datasets
(streaming.py) and a user's own collator (user_collator.py)."""
