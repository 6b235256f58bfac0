"""An example rlkit plugin (see hooks.py and scores.py)."""
