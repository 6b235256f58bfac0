"""The RL step: the trainer (fit, step) and one module per phase."""
