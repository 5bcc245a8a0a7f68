"""The DeepSpeed config the learner generates: fp32 gradient accumulation for 16-bit models."""
from __future__ import annotations

import pytest

from common.config import LearnerConfig
from learner.engines import ds_config


def _accum(config: dict):
    return config.get("data_types", {}).get("grad_accum_dtype")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_model_accumulates_gradients_in_fp32(stage):
    config = ds_config(LearnerConfig(zero_stage=stage), on_gpu=True)
    assert config["bf16"]["enabled"] and _accum(config) == "fp32"


def test_an_fp16_model_set_through_learner_deepspeed_accumulates_in_fp32_too():
    cfg = LearnerConfig(zero_stage=2, deepspeed={"bf16": {"enabled": False}, "fp16": {"enabled": True}})
    assert _accum(ds_config(cfg, on_gpu=True)) == "fp32"


def test_an_fp32_model_is_left_to_deepspeed():
    assert _accum(ds_config(LearnerConfig(zero_stage=2), on_gpu=False)) is None


def test_zero_stage_0_is_left_as_is_deepspeed_refuses_the_mix_there():
    assert _accum(ds_config(LearnerConfig(zero_stage=0), on_gpu=True)) is None


def test_a_grad_accum_dtype_set_by_the_user_wins():
    cfg = LearnerConfig(zero_stage=3, deepspeed={"data_types": {"grad_accum_dtype": "bf16"}})
    assert _accum(ds_config(cfg, on_gpu=True)) == "bf16"


def test_other_deepspeed_settings_merge_beside_it():
    cfg = LearnerConfig(zero_stage=3, deepspeed={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    config = ds_config(cfg, on_gpu=True)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert _accum(config) == "fp32"
