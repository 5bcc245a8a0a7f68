"""A reward_model verifier whose folder cannot serve: one line, before any actor starts."""
from __future__ import annotations

import json

import pytest

from cluster.cli.compose import ConfigError, load_config

GOOD = {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}, "pad_token_id": 0}


def folder(tmp_path, **config):
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    return str(tmp_path)


def overrides(path):
    return ["reward.verifiers=[reward_model,format]", "+reward.weights.reward_model=1.0", f"reward.model.path={path}"]


@pytest.mark.parametrize("config,words", [
    ({**GOOD, "architectures": ["Qwen2ForCausalLM"]}, "no sequence-classification head"),
    ({**GOOD, "id2label": {"0": "a", "1": "b"}}, "a head of 2 logits"),
    ({k: v for k, v in GOOD.items() if k != "id2label"}, "a head of 2 logits"),  # transformers' default
    ({k: v for k, v in GOOD.items() if k != "pad_token_id"}, "no pad_token_id"),
])
def test_a_folder_that_is_not_a_one_logit_classifier_is_one_line(tmp_path, config, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides(folder(tmp_path, **config)))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_missing_folder_or_path_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(overrides(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="reward.model.path is required"):
        load_config(["reward.verifiers=[reward_model]", "+reward.weights.reward_model=1.0"])


def test_a_one_logit_classifier_passes(tmp_path):
    cfg = load_config(overrides(folder(tmp_path, **GOOD)) + ["reward.model.normalize=sigmoid"])
    assert cfg.reward.model.normalize == "sigmoid"
    with pytest.raises(ConfigError, match="reward.model.normalize must be one of none, sigmoid"):
        load_config(overrides(folder(tmp_path, **GOOD)) + ["reward.model.normalize=tanh"])
