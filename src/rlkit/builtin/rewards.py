"""Registers rlkit's built-in rewards entries through the public hooks."""

from __future__ import annotations
