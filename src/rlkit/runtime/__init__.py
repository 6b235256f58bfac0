"""Set-up and clean-up of a run: build, stop, watchdog, checkpoints, tracking, merge."""
