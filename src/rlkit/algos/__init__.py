"""rlkit.algos."""
