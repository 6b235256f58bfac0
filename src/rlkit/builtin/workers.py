"""Registers rlkit's built-in workers entries through the public hooks."""

from __future__ import annotations
