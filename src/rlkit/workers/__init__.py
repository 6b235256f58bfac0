"""rlkit.workers."""
