"""GGUF files from rlkit's HF Llama weights, for benchmarks/llamacpp_spike.py (issue 30, item 5).

``gguf_arrays`` maps an HF state dict to llama.cpp's tensor names (q/k rows reordered to its rope layout),
``write_gguf`` writes them with another GGUF's metadata (tokenizer, hyper-parameters), and ``MappedWeights``
rewrites tensors of a written file in place: a llama.cpp model loaded from it with mmap computes with the new
bytes at its next decode (weight sync without a reload).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlkit.errors import RlkitError

__all__ = [
    "LAYER_NAMES",
    "TOP_NAMES",
    "gguf_name",
    "rope_rows",
    "gguf_arrays",
    "encode",
    "write_gguf",
    "MappedWeights",
]

# HF LlamaForCausalLM parameter → llama.cpp tensor name (the per-layer part after "model.layers.{i}.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for an HF Llama parameter; None for ``lm_head.weight`` (tied to the embedding)."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    if hf_name == "lm_head.weight":
        return None
    prefix, _, rest = hf_name.partition(".layers.")
    layer, _, leaf = rest.partition(".")
    if prefix != "model" or not layer.isdigit() or leaf not in LAYER_NAMES:
        raise RlkitError(
            f"no llama.cpp name for HF parameter {hf_name!r}: the GGUF writer knows the Llama architecture's "
            f"parameters only ({', '.join(sorted(LAYER_NAMES))} under model.layers.N, plus "
            f"{', '.join(TOP_NAMES)}); convert other architectures with llama.cpp's convert_hf_to_gguf.py"
        )
    return f"blk.{layer}.{LAYER_NAMES[leaf]}"


def rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the rows of a q/k projection ``[heads · head_dim, in]`` from HF's rotate-half rope layout
    (each head's first half, then its second half) to llama.cpp's interleaved pairs (row j of the first
    half next to row j of the second)."""
    out_dim = weight.shape[0]
    half = out_dim // heads // 2
    return weight.reshape(heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_arrays(state: dict, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """The HF ``state`` dict (torch tensors) as float32 arrays under llama.cpp's names, q/k permuted."""
    arrays = {}
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        array = tensor.detach().float().numpy()
        if name.endswith("attn_q.weight"):
            array = rope_rows(array, heads)
        elif name.endswith("attn_k.weight"):
            array = rope_rows(array, kv_heads)
        arrays[name] = array
    return arrays


def encode(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` (float32) in the GGUF dtype a weight is stored in: 1-D tensors (norms) stay float32; bf16
    as its raw uint16 bits (round to nearest even, torch's conversion)."""
    if array.ndim == 1 or dtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "f16":
        return array.astype(np.float16)
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16).view(torch.int16).numpy()


def write_gguf(path: Path, source: Path, arrays: dict[str, np.ndarray], dtype: str) -> Path:
    """A GGUF file at ``path``: ``source``'s metadata (tokenizer, hyper-parameters) and ``arrays`` stored in
    ``dtype``."""
    import gguf

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
    file_type["bf16"] = gguf.LlamaFileType.MOSTLY_BF16
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(file_type[dtype])
    for name, array in arrays.items():
        data = encode(array, dtype)
        raw = gguf.GGMLQuantizationType.BF16 if data.dtype == np.int16 else None
        writer.add_tensor(name, data, raw_shape=array.shape if raw else None, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class MappedWeights:
    """Each tensor of a GGUF file as a writable view of the file (``np.memmap``, shared pages): writing one
    changes what a llama.cpp model loaded from that file with mmap computes with, without a reload."""

    def __init__(self, path: Path):
        import gguf

        reader = gguf.GGUFReader(path)
        self.file = np.memmap(path, dtype=np.uint8, mode="r+")
        self.slots = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}

    def write(self, name: str, data: np.ndarray) -> None:
        offset, n_bytes = self.slots[name]
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size != n_bytes:
            raise RlkitError(
                f"GGUF tensor {name}: {raw.size} bytes for a slot of {n_bytes}; an in-place write needs "
                "the file's dtype and shape (encode() with the dtype the file was written in)"
            )
        self.file[offset : offset + n_bytes] = raw

    def sync(self, arrays: dict[str, np.ndarray], dtype: str) -> None:
        """Every tensor rewritten in place (a training step's full weight sync)."""
        for name, array in arrays.items():
            self.write(name, encode(array, dtype))
