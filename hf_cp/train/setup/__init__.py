"""What a run is set up from: the training arguments (args.py), the YAML config and its schema
(config.py, schema.py), FSDP2 / ZeRO-3 sharding (sharding.py) and the parts a trainer builds
(trainer_setup.py)."""
