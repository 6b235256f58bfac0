"""Registers rlkit's built-in rollout entries through the public hooks."""

from __future__ import annotations
