"""Every `grpo train` / `grpo submit` command in the README and the docs composes, and composes to
what it says: a command that names its own model loads it as `model=hf` with a learning rate set
for it, a GPU layout gives every engine and rank whole GPUs of their own, and each labelled
recipe (`<!-- recipe: NAME -->` just before its code block) composes to the keys in RECIPES.

Pure Hydra composition (cluster/cli/compose.py), no actors. Also: `model.path` with the built-in
model is refused unless it is the builder's own folder.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cluster.cli.compose import ConfigError, _check_model, compose_config, load_config, resolve_auto
from cluster.layout import check_gpu_layout
from common.config import Config
from data.prompts import use_chat_template

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GSM8K = {
    "model.name": "hf", "model.path": "Qwen/Qwen2.5-0.5B-Instruct", "learner.lr": 1e-6,
    "chat template": True, "data.source": "hf", "data.name": "openai/gsm8k", "data.eval_split": "test",
    "reward.verifiers": ["math"], "warmup.steps": 0, "rollout.dtype": "bfloat16",
    "rollout.num_workers": 4, "rollout.num_gpus_per_worker": 1, "rollout.tensor_parallel_size": 1,
    "learner.num_ranks": 4, "learner.num_gpus_per_rank": 1, "learner.max_tokens_per_microbatch": 16384,
}
# The keys each labelled recipe must compose to: the model kind, the lr, the template, the layout.
RECIPES = {
    "gsm8k": {**GSM8K, "cluster.nodes.rollout": None, "cluster.nodes.learner": None},
    "gsm8k-multi-node": {**GSM8K, "cluster.nodes.rollout": "gen", "cluster.nodes.learner": "train"},
    "local-model": {"model.name": "hf", "model.path": "/models/Qwen2.5-0.5B-Instruct", "learner.lr": 1e-6,
                    "chat template": True, "rollout.dtype": "bfloat16", "rollout.num_gpus_per_worker": 0},
}
FENCE = re.compile(r"(?:<!-- recipe: (?P<label>[\w-]+) -->\n)?```(?:bash)?\n(?P<body>.*?)```", re.S)
SUBMIT_OPTIONS = {"--address": 1, "--job-id": 1, "--no-follow": 0, "--cfg": 0}


def documented_commands():
    """(page, label or None, overrides) for every train/submit command in a fenced block."""
    for page in PAGES:
        for block in FENCE.finditer(page.read_text()):
            text = block.group("body").replace("\\\n", " ")
            for line in text.splitlines():
                line = line.split(" # ")[0].strip()
                match = re.match(r"(?:\.venv/bin/)?grpo (train|submit)\b(.*)", line)
                if match:
                    yield page.relative_to(ROOT), block.group("label"), _overrides(shlex.split(match.group(2)))


def _overrides(tokens):
    out, skip = [], 0
    for token in tokens:
        if skip:
            skip -= 1
        elif token in SUBMIT_OPTIONS:
            skip = SUBMIT_OPTIONS[token]
        elif token != "...":  # a placeholder for the rest of a command shown above it
            out.append(token)
    return out


def composed(overrides) -> Config:
    """What the CLI composes, with the checks that need no files or imports of the user's code."""
    cfg = OmegaConf.to_object(compose_config(overrides))
    cfg.check()
    _check_model(cfg)
    return resolve_auto(cfg)


def value(cfg: Config, key: str):
    if key == "chat template":  # the decision data/prompts.py takes for a tokenizer with a template
        name = cfg.model.path if cfg.model.name == "hf" else cfg.model.name
        return use_chat_template(cfg.data.chat_template, True, False, cfg.data.system_prompt, name)
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


COMMANDS = list(documented_commands())


def test_the_docs_show_commands_and_every_recipe():
    assert len(COMMANDS) >= 10
    labels = {label for _, label, _ in COMMANDS if label}
    assert labels == set(RECIPES), f"labelled in the docs: {sorted(labels)}; with a table here: {sorted(RECIPES)}"
    assert {page.name for page, label, _ in COMMANDS if label == "gsm8k"} >= {"README.md", "cluster.md"}


@pytest.mark.parametrize("page, label, overrides", COMMANDS, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(COMMANDS)])
def test_a_documented_command_composes_to_what_it_says(page, label, overrides):
    cfg = composed(overrides)
    if cfg.model.name == "hf":  # its own model: the tiny model's learning rate would wreck it
        assert any(o.startswith("learner.lr=") for o in overrides), f"{page}: {overrides} sets no learner.lr"
    gpus = cfg.rollout.num_gpus_per_worker * cfg.rollout.num_workers + cfg.learner.num_gpus_per_rank * cfg.learner.num_ranks
    if gpus:
        check_gpu_layout(cfg, gpus)
        assert cfg.learner.num_gpus_per_rank == 1, f"{page}: a GPU cluster needs learner.num_gpus_per_rank=1"
    if any(o.startswith(("model=", "model.")) for o in overrides) or gpus:
        assert label, f"{page}: {overrides} chooses a model or a GPU layout: label it <!-- recipe: NAME --> " \
                      "and give it a table in RECIPES"
    if label:
        wrong = {key: value(cfg, key) for key, want in RECIPES[label].items() if value(cfg, key) != want}
        assert not wrong, f"{page} recipe {label} composes to {wrong}, not {RECIPES[label]}"


def test_a_user_model_path_with_the_built_in_model_is_refused(tmp_path):
    for path in (str(tmp_path / "mine"), "Qwen/Qwen2.5-0.5B-Instruct"):
        with pytest.raises(ConfigError) as info:
            load_config([f"model.cache_dir={tmp_path}", f"model.path={path}"])
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"model.path='{path}' with model.name=tiny")
        assert "model=hf" in message and "learner.lr" in message
    assert load_config(["model=hf", "model.path=Qwen/Qwen2.5-0.5B-Instruct"]).model.name == "hf"


def test_the_builder_s_own_folder_is_accepted_with_the_built_in_model(tmp_path):
    from data.tiny_model import tiny_model_dir

    cfg = load_config([f"model.cache_dir={tmp_path}"])
    built = tiny_model_dir(cfg.model, cfg.trainer.seed)
    assert load_config([f"model.cache_dir={tmp_path}", f"model.path={built}"]).model.path == str(built)
    tools = ["rollout.tools=[calculator]", f"model.cache_dir={tmp_path}"]
    with_tags = tiny_model_dir(load_config(tools).model, 0, tool_tags=True)
    assert load_config([*tools, f"model.path={with_tags}"]).model.path == str(with_tags)
