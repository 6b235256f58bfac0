"""transformers' KV-cache keyword in the version installed: ``cache`` where the model's forward takes it
(transformers 5.2x renamed ``past_key_values``, warns on the old name and removes it in 5.40), else
``past_key_values`` (transformers 4.56 up to the rename). The same for the output's field.

    out = module(input_ids=ids, use_cache=True, **cache_argument(module, cache))
    cache = output_cache(out)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from torch import nn

__all__ = ["cache_argument", "output_cache"]


@functools.cache
def _keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_argument(module: nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``module`` 's forward (a PEFT model: its base model's keyword, which its
    forward passes on)."""
    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    return {_keyword(type(base)): cache}


def output_cache(output: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned (``output.cache``, or the old field)."""
    fields = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    return output.cache if "cache" in fields else output.past_key_values
