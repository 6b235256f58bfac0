"""Registers rlkit's built-in tools entries through the public hooks."""

from __future__ import annotations
