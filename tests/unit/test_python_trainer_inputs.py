"""cluster/trainer.py: Python values become `grpo train`'s overrides and config; datasets become a
JSONL file; a lambda reward is pickled into the config and scored in the real verifier child;
bad input is one line (status 2 from a script) before anything starts."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cluster.cli.compose import load_config
from cluster.trainer import GRPOTrainer
from common.config import ConfigError
from common.plugins import PICKLED, load_function

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a % 3} for a in range(10, 30)]


def test_python_values_become_the_same_config_as_the_command_line(tmp_path):
    prompt = "Answer in <answer></answer>, it's \\boxed{} too."
    trainer = GRPOTrainer(trainer={"max_steps": 3, "output_dir": str(tmp_path)}, logger=["tensorboard", "mlflow"],
                          config={"algo.beta": 0.0, "data": {"system_prompt": prompt}, "rollout.stop": ["\n\n", "x y"]})
    cfg = trainer.config()
    assert (cfg.trainer.max_steps, cfg.algo.beta, cfg.data.system_prompt) == (3, 0.0, prompt)
    assert cfg.rollout.stop == ["\n\n", "x y"] and cfg.logger.backends == ["tensorboard", "mlflow"]
    assert load_config(trainer.overrides()) == cfg  # what `grpo train` makes of the same overrides
    # A list of strings is taken as the command line takes it, after the keyword arguments.
    assert GRPOTrainer(trainer={"max_steps": 3}, config=["trainer.max_steps=5"]).config().trainer.max_steps == 5
    hf = GRPOTrainer(model=str(tmp_path / "my-model")).overrides()
    assert hf[:2] == ["model=hf", f"model.path='{tmp_path / 'my-model'}'"]


def test_a_list_and_a_dataset_become_one_jsonl_file(tmp_path):
    import datasets

    from data.datasets import load_problems

    out = {"trainer": {"output_dir": str(tmp_path)}, "data": {"heldout_size": 4}}
    from_list = GRPOTrainer(train_dataset=ROWS, **out).config()
    from_dataset = GRPOTrainer(train_dataset=datasets.Dataset.from_list(ROWS), **out).config()
    assert from_list.data.source == "jsonl" and from_list.data.path == from_dataset.data.path
    assert Path(from_list.data.path).parent == tmp_path / "inputs"
    heldout, train = load_problems(from_list.data, seed=0)
    assert sorted(p.prompt for p in heldout + train) == sorted(r["prompt"] for r in ROWS)
    assert {p.fields["level"] for p in train} <= {0, 1, 2}


def test_a_lambda_reward_scores_in_the_verifier_process(tmp_path):
    """The lambda travels in the config and runs in the `python -m reward.scorer` child."""
    from common.messages import ScoringRequest
    from reward.scorer import VerifierScorer

    limit = 7
    trainer = GRPOTrainer(train_dataset=ROWS, trainer={"output_dir": str(tmp_path)},
                          reward_funcs=["math", lambda completions, level, **_: [float(len(c) <= limit) + lv
                                                                               for c, lv in zip(completions, level)]],
                          reward_weights=[1.0, 0.5])
    reward = trainer.config().reward
    assert reward.verifiers == ["math", "reward_1"] and reward.custom["reward_1"].startswith(PICKLED)
    assert reward.weights["math"] == 1.0 and reward.weights["reward_1"] == 0.5
    scorer = VerifierScorer(reward)
    try:
        got = scorer.score([ScoringRequest("1+1=", "<answer>2</answer>", "2", {"level": 2}),
                            ScoringRequest("1+1=", "2", "2", {"level": 0})])
    finally:
        scorer._kill()
    assert [o.scores["reward_1"] for o in got] == [2.0, 1.0]
    # math: the first answers in the R1 layout, the second gives a bare "2", which math does not read.
    assert [o.scores["math"] for o in got] == [1.0, 0.0]
    assert [o.reward for o in got] == [pytest.approx(1.0 + 0.5 * 2.0), pytest.approx(0.5 * 1.0)]


def test_tools_and_agents_are_shipped_too(tmp_path):
    def word_count(text: str) -> str:
        return str(len(text.split()))

    cfg = GRPOTrainer(tools=["calculator", word_count], trainer={"output_dir": str(tmp_path)},
                      data="mul").config()
    assert cfg.rollout.tools == ["calculator"]
    assert load_function(cfg.rollout.custom_tools["word_count"])("a b c") == "3"


LOCK = threading.Lock()


@pytest.mark.parametrize("kwargs,needle", [
    ({"reward_funcs": [lambda text: [1.0]]}, "reward_funcs[0] (reward_0): cannot be called as fn(prompts=[...]"),
    ({"train_dataset": ROWS, "reward_funcs": {"r": lambda prompts, completions, answer: [0.0]}},
     "got an unexpected keyword argument 'level'"),
    ({"reward_funcs": [lambda completions, lock=LOCK, **_: [0.0]]},
     "cannot be pickled to send it to the verifier processes (TypeError: cannot pickle '_thread.lock' object)"),
    ({"train_dataset": [{"question": "1+1=", "answer": "2"}]}, "train_dataset has no 'prompt' column"),
    ({"train_dataset": ROWS, "config": {"data.prompt_key": "question"}}, "no 'question' column (data.prompt_key)"),
    ({"train_dataset": "rows.jsonl"}, "train_dataset must be a list of dicts or a datasets.Dataset"),
    ({"reward_funcs": lambda completions, **_: [0.0]}, "reward_funcs must be a list or a dict"),
    ({"reward_funcs": ["nosuch"]}, "unknown verifier 'nosuch'"),
    ({"logger": "comet"}, "logger/comet"),
    ({"config": {"logger.mlflow_tracking_uri": "mlflow.example:5000", "logger": "mlflow"}}, "the scheme"),
    ({"trainer": {"max_stepz": 2}}, "unknown config key 'trainer.max_stepz'"),
])
def test_bad_input_is_one_line(tmp_path, kwargs, needle):
    kwargs.setdefault("config", {})
    kwargs["config"] = {**kwargs["config"], "trainer.output_dir": str(tmp_path)}
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(**kwargs).config()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_script_with_bad_input_exits_2_with_one_line(tmp_path):
    """The worked example as a user runs it, with a typo: one line on stderr, status 2, no actor."""
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_from_python.py"), "trainer.max_stepz=2",
                             f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "Triton" not in line]
    assert errors == ["grpo: error: unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)"]
    assert not (tmp_path / "inputs").exists()  # refused before even the dataset was written
