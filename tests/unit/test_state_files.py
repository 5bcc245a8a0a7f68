"""Whole-model weights written a block at a time (common/state_files.py): shards cut at their
size, a tied weight written once and answered under both names, and a folder transformers loads
as the model it was written from."""
from __future__ import annotations

import json

import pytest
import torch

from common import state_files


def test_blocks_become_shards_and_read_back_with_tied_names(tmp_path):
    embedding = torch.randn(16, 8)
    blocks = [{"embed.weight": embedding},
              {"layers.0.a": torch.randn(8, 8), "layers.0.b": torch.arange(8, dtype=torch.int64)},
              {"layers.1.a": torch.randn(8, 8).to(torch.bfloat16)},
              {"head.weight": embedding}]
    # 300 bytes a shard: the embedding (512 B) alone, layer 0 (320 B) alone, then layer 1.
    state_files.write(str(tmp_path), iter(blocks), shard_bytes=300)
    index = json.loads((tmp_path / state_files.INDEX).read_text())
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["aliases"] == {"head.weight": "embed.weight"} and "head.weight" not in index["weight_map"]
    assert index["metadata"]["total_size"] == 16 * 8 * 4 + 8 * 8 * 4 + 8 * 8 + 8 * 8 * 2
    read = state_files.StateFiles(str(tmp_path))
    expected = {k: v for block in blocks for k, v in block.items()}
    assert sorted(read) == sorted(expected) and len(read) == len(expected)
    for name, value in expected.items():
        assert read[name].dtype == value.dtype and torch.equal(read[name], value), name
    with pytest.raises(KeyError):
        read["missing"]


@pytest.mark.parametrize("shard_bytes", [state_files.SHARD_BYTES, 5_000])
def test_transformers_loads_what_was_written_block_by_block(tmp_path, shard_bytes):
    """A tied Qwen2 written block by block (its output head the embedding), in one
    model.safetensors or in several shards, is what transformers loads, the head tied again."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    state_files.write(str(tmp_path), ({name: value} for name, value in state.items()), shard_bytes)
    config.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model.safetensors"] if shard_bytes == state_files.SHARD_BYTES else len(files) > 2, files
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


def test_a_block_is_a_transformer_layer_and_an_adapted_head_comes_with_its_adapters():
    """What learner/engines.py gathers at once under ZeRO-3: a merged LoRA export needs a
    weight and its adapters in the same block, also outside the numbered layers."""
    from learner.engines import _blocks

    embed, norm = "base_model.model.model.embed_tokens.weight", "base_model.model.model.norm.weight"
    layer0 = ["base_model.model.model.layers.0.q.base_layer.weight", "base_model.model.model.layers.0.q.lora_A.default.weight",
              "base_model.model.model.layers.0.q.lora_B.default.weight"]
    layer1 = ["base_model.model.model.layers.1.q.weight"]
    head = ["base_model.model.lm_head.base_layer.weight", "base_model.model.lm_head.lora_A.default.weight",
            "base_model.model.lm_head.lora_B.default.weight"]
    assert _blocks([embed, *layer0, *layer1, norm, *head]) == [[embed], layer0, layer1, [norm], head]
