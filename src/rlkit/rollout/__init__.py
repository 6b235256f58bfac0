"""rlkit.rollout."""
