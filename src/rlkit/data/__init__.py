"""rlkit.data: preprocessors (GSM8K, MATH-500, synthetic arithmetic), parquet datasets and samplers.

The preprocessors need only pyarrow. The dataset and dataloader (torch) live in their own modules:
``from rlkit.data.dataset import RLDataset``, ``from rlkit.data.sampler import StatefulDataLoader``.
"""

from __future__ import annotations

from rlkit.data.gsm8k import preprocess_gsm8k
from rlkit.data.math500 import preprocess_math500
from rlkit.data.synthetic import generate_arithmetic

__all__ = ["preprocess_gsm8k", "preprocess_math500", "generate_arithmetic"]
