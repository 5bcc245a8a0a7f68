"""Qwen2 models of about 10 M, 100 M and 500 M parameters for the benchmarks, built (once) the
way the built-in model is: random weights, the character-level tokenizer, a Hugging Face folder
that both DeepSpeed and vLLM load."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import ModelConfig  # noqa: E402

# name -> (hidden, layers, MLP width); heads of 64 dimensions. Parameter counts are printed by
# the benchmarks from the built model, not taken from these names.
SIZES = {
    "10M": (256, 10, 1024),
    "100M": (768, 12, 3072),
    "500M": (1280, 24, 3584),
}


def model_config(size: str, cache_dir: str, tied: bool = True) -> ModelConfig:
    hidden, layers, mlp = SIZES[size]
    return ModelConfig(name="tiny", cache_dir=cache_dir, hidden_size=hidden, num_layers=layers,
                       num_heads=hidden // 64, intermediate_size=mlp, max_position_embeddings=256,
                       tie_word_embeddings=tied)


def build(size: str, cache_dir: str, tied: bool = True) -> str:
    from data.tiny_model import build_tiny_model

    return build_tiny_model(model_config(size, cache_dir, tied), seed=0)
