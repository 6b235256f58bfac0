"""reasoning-gym tasks as an rlkit environment (docs/environments.md)."""
