"""rlkit.rewards."""
