"""TextArena games as multi-turn rlkit environments (docs/environments.md)."""
