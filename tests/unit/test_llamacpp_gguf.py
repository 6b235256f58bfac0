"""benchmarks/llamacpp_gguf.py, the GGUF writer of the llama.cpp spike (issue 30 item 5): HF → llama.cpp
names, the q/k rope row order, and writing one tensor in place in a GGUF file. Pure numpy + the ``gguf``
package; no llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlkit.errors import RlkitError


@pytest.fixture(scope="module")
def spike(benchmark_module):
    return benchmark_module("llamacpp_gguf.py")


def test_every_llama_parameter_has_its_llama_cpp_name(spike):
    assert spike.gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert spike.gguf_name("model.norm.weight") == "output_norm.weight"
    assert spike.gguf_name("lm_head.weight") is None  # tied: llama.cpp reuses token_embd
    assert spike.gguf_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert spike.gguf_name("model.layers.29.mlp.down_proj.weight") == "blk.29.ffn_down.weight"
    assert spike.gguf_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    names = {spike.gguf_name(f"model.layers.7.{leaf}") for leaf in spike.LAYER_NAMES}
    assert len(names) == len(spike.LAYER_NAMES)  # no two parameters share a slot
    with pytest.raises(RlkitError, match="convert_hf_to_gguf"):
        spike.gguf_name("model.layers.0.self_attn.q_norm.weight")


def test_rope_rows_interleave_each_heads_halves(spike):
    """HF's rotate-half layout keeps a head's rotation pairs D/2 rows apart; llama.cpp's keeps them adjacent:
    row 2j of a head comes from row j, row 2j + 1 from row D/2 + j."""
    heads, head_dim, cols = 3, 4, 2
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    out = spike.rope_rows(weight, heads)
    for h in range(heads):
        for j in range(head_dim // 2):
            np.testing.assert_array_equal(out[h * head_dim + 2 * j], weight[h * head_dim + j])
            np.testing.assert_array_equal(
                out[h * head_dim + 2 * j + 1], weight[h * head_dim + head_dim // 2 + j]
            )


def _source_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_a_tensor_written_in_place_reads_back_and_nothing_else_moves(spike, tmp_path, dtype):
    import gguf

    rng = np.random.default_rng(0)
    arrays = {
        "blk.0.attn_q.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(4).astype(np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((6, 4)).astype(np.float32),
    }
    path = spike.write_gguf(tmp_path / "m.gguf", _source_gguf(tmp_path / "src.gguf"), arrays, dtype)
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.eos_token_id"].contents() == 2  # metadata copied
    new = arrays["blk.0.attn_q.weight"] * 1.5
    spike.MappedWeights(path).write("blk.0.attn_q.weight", spike.encode(new, dtype))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, array in arrays.items():
        expected = spike.encode(new if name == "blk.0.attn_q.weight" else array, dtype)
        stored = np.asarray(tensors[name].data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(stored, expected.view(np.uint8).reshape(-1))
    with pytest.raises(RlkitError, match="dtype and shape"):
        spike.MappedWeights(path).write("blk.0.attn_q.weight", new[:3])
