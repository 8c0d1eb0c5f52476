"""What is refused at set-up, before anything runs: the process layout and attention (setup.py),
the model's features (model.py), the launch against the config (launch.py)."""
