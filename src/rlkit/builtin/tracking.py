"""Registers rlkit's built-in tracking entries through the public hooks."""

from __future__ import annotations
