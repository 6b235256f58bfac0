"""Registers rlkit's built-in algorithms entries through the public hooks."""

from __future__ import annotations
