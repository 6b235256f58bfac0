"""rlkit.recipe."""
