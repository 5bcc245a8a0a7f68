"""What the model sees (data/prompts.py): templates, system prompts, the built-in model's chat
template through the real `apply_chat_template`, conversational rows, stops, and bad input."""
from __future__ import annotations

import json

import pytest

from common.config import DataConfig
from common.problem import Problem
from data.datasets import DataError, load_problems
from data.prompts import render, stop_token_ids, use_chat_template

ROW = Problem(prompt="Ann has 3 pens and gets 4 more.", answer="7", fields={"name": "Ann"})
CONVERSATION = Problem(prompt="2+2=", answer="4", messages=(("system", "Be brief."), ("user", "2+2=")))


@pytest.fixture(scope="module")
def tokenizer():
    from data.tiny_model import build_tokenizer

    return build_tokenizer()


def test_plain_prompt_template_and_system_prompt(tokenizer):
    assert render(ROW, "row 1", None, None, False, tokenizer) == "Ann has 3 pens and gets 4 more."
    template = "{question} Put your final answer within \\boxed{{}}. ({name})"
    assert render(ROW, "row 1", template, None, False, tokenizer, prompt_key="question") == \
        "Ann has 3 pens and gets 4 more. Put your final answer within \\boxed{}. (Ann)"
    assert render(ROW, "row 1", "Q: {prompt}", "You count.", False, tokenizer) == \
        "You count.\n\nQ: Ann has 3 pens and gets 4 more."


def test_chat_template_of_the_built_in_model(tokenizer):
    assert render(ROW, "row 1", "Q: {prompt}", "You count.", True, tokenizer) == (
        "<|im_start|>system\nYou count.<|im_end|>\n"
        "<|im_start|>user\nQ: Ann has 3 pens and gets 4 more.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render(ROW, "row 1", None, None, True, tokenizer) == (
        "<|im_start|>user\nAnn has 3 pens and gets 4 more.<|im_end|>\n<|im_start|>assistant\n")


def test_conversational_rows_keep_their_messages(tokenizer):
    # the template formats the last user message; the row's own system message wins
    assert render(CONVERSATION, "row 1", "{prompt} Think.", "Ignored: the row has one.", True, tokenizer) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2= Think.<|im_end|>\n<|im_start|>assistant\n")
    assert render(CONVERSATION, "row 1", None, None, False, tokenizer) == "Be brief.\n\n2+2="


def test_auto_applies_the_chat_template_when_it_should():
    assert use_chat_template("auto", True, True, None, "x") is True            # conversational rows
    assert use_chat_template("auto", True, False, "sys", "x") is True          # a system prompt
    assert use_chat_template("auto", True, False, None, "Qwen2.5-0.5B-Instruct") is True
    assert use_chat_template("auto", True, False, None, "tiny") is False       # the built-in job: plain
    assert use_chat_template("auto", False, False, "sys", "x-Instruct") is False
    assert use_chat_template("true", True, False, None, "tiny") is True
    assert use_chat_template("false", True, False, None, "x-chat") is False


@pytest.mark.parametrize("call, words", [
    (lambda: use_chat_template("true", False, False, None, "m"), ["chat_template=true", "no chat template"]),
    (lambda: use_chat_template("false", True, True, None, "m"), ["chat_template=false", "conversations"]),
    (lambda: use_chat_template("auto", False, True, None, "m"), ["conversations", "no chat template"]),
    (lambda: render(ROW, "train row 3", "{question}", None, False, None), ["'question'", "train row 3"]),
    (lambda: render(ROW, "train row 1", "{0}", None, False, None), ["prompt_template"]),
    (lambda: render(ROW, "train row 1", "{unclosed", None, False, None), ["prompt_template"]),
])
def test_bad_templates_are_one_line_errors(call, words):
    with pytest.raises(DataError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_stops_include_the_end_of_turn_token(tokenizer, tmp_path):
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(str(tmp_path), tokenizer, chat=False) == [tokenizer.eos_token_id]
    assert stop_token_ids(str(tmp_path), tokenizer, chat=True) == sorted({tokenizer.eos_token_id, turn_end})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, tokenizer.eos_token_id]}))
    assert stop_token_ids(str(tmp_path), tokenizer, chat=False) == sorted({5, tokenizer.eos_token_id})


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversational_rows_load_from_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"}], "answer": str(i)}
            for i in range(10)]
    _, train = load_problems(DataConfig(source="jsonl", path=_rows(tmp_path / "c.jsonl", rows), heldout_size=2), 0)
    assert all(p.messages[0] == ("system", "s") and p.prompt == p.messages[1][1] for p in train)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    _, from_parquet = load_problems(DataConfig(source="jsonl", path=str(tmp_path / "c.parquet"), heldout_size=2), 0)
    assert from_parquet == train


def test_conversational_rows_load_from_datasets(tmp_path):
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(10)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    _, train = load_problems(DataConfig(source="hf", path=str(tmp_path / "ds"), heldout_size=2), 0)
    assert all(p.messages == (("user", p.prompt),) for p in train)


@pytest.mark.parametrize("prompt, words", [
    ([{"role": "robot", "content": "x"}], ["line 1", "message 0", "robot"]),
    ([{"role": "user"}], ["line 1", "content"]),
    ([{"role": "system", "content": "x"}], ["line 1", "no user message"]),
    ([], ["line 1", "non-empty list"]),
    (["just text"], ["line 1", "message 0"]),
])
def test_bad_conversations_are_one_line_errors(tmp_path, prompt, words):
    path = _rows(tmp_path / "bad.jsonl", [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError) as error:
        load_problems(DataConfig(source="jsonl", path=path), 0)
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words), str(error.value)


def test_eval_set_from_a_file_and_its_bad_rows(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    test = _rows(tmp_path / "test.jsonl", [{"prompt": f"t{i}", "answer": str(i)} for i in range(3)])
    heldout, rows = load_problems(DataConfig(source="jsonl", path=train, eval_path=test), 0)
    assert [p.prompt for p in heldout] == ["t0", "t1", "t2"] and len(rows) == 10  # every training row trains
    no_answer = _rows(tmp_path / "noanswer.jsonl", [{"prompt": "t0"}])
    with pytest.raises(DataError, match="data.eval_path .*noanswer.jsonl line 1: no 'answer' field"):
        load_problems(DataConfig(source="jsonl", path=train, eval_path=no_answer), 0)


def test_gold_answers_from_gsm8k_math_and_plain_fields(tmp_path):
    rows = [{"prompt": "a", "answer": "3 + 4 = 7\n#### 7"}, {"prompt": "b", "answer": "so $\\boxed{\\frac{1}{2}}$."},
            {"prompt": "c", "answer": 12}, {"prompt": "d", "answer": "1,234"}, {"prompt": "e", "answer": "x"}]
    heldout, train = load_problems(DataConfig(source="jsonl", path=_rows(tmp_path / "g.jsonl", rows), heldout_size=0), 0)
    answers = {p.prompt: p.answer for p in heldout + train}
    assert answers == {"a": "7", "b": "\\frac{1}{2}", "c": "12", "d": "1234", "e": "x"}


@pytest.mark.parametrize("tool_tags", [False, True])
def test_the_built_in_models_tokenizer_loads_as_autotokenizer_loads_it(tmp_path, tool_tags):
    """load_tokenizer skips AutoTokenizer for the built-in model's folder: the same class, vocabulary,
    special tokens, chat template and encodings as AutoTokenizer gives."""
    from transformers import AutoTokenizer

    from data.prompts import load_tokenizer
    from data.tiny_model import build_tokenizer

    build_tokenizer(tool_tags).save_pretrained(tmp_path)
    direct, auto = load_tokenizer(str(tmp_path), built_in=True), AutoTokenizer.from_pretrained(tmp_path)
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab() and direct.all_special_tokens == auto.all_special_tokens
    assert (direct.eos_token_id, direct.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    assert direct.chat_template == auto.chat_template
    texts = [render(CONVERSATION, "row 1", None, None, True, auto), "47+85=<think>7+5+0=12</think>", "héllo\n"]
    assert [direct(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]


def test_a_built_in_folder_that_names_no_exported_class_goes_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    from data.prompts import load_tokenizer
    from data.tiny_model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    for name in (None, "NoSuchTokenizer"):
        fields = json.loads(config.read_text())
        fields.pop("tokenizer_class", None) if name is None else fields.update(tokenizer_class=name)
        config.write_text(json.dumps(fields))
        loaded = load_tokenizer(str(tmp_path), built_in=True)
        assert type(loaded) is type(AutoTokenizer.from_pretrained(tmp_path)), name


def test_only_the_folder_the_builder_made_counts_as_the_built_in_model(tmp_path):
    """A folder the user names (model=hf model.path) goes through AutoTokenizer; so does a built-in
    folder made for other settings (with or without tool tags). With the tiny model's group a
    folder of the user's is refused (tests/unit/test_recipes.py)."""
    from cluster.cli.compose import load_config
    from cluster.cli.checks import is_built_in
    from data.tiny_model import tiny_model_dir

    cfg = load_config([f"model.cache_dir={tmp_path}"])
    cfg.model.path = str(tiny_model_dir(cfg.model, cfg.trainer.seed))  # what resolve_model returns
    assert is_built_in(cfg)
    tools = load_config([f"model.cache_dir={tmp_path}", "rollout.tools=[calculator]"])
    tools.model.path = cfg.model.path
    assert not is_built_in(tools)
    for overrides in (["model=hf", f"model.path={tmp_path / 'mine'}"], ["model=hf", "model.path=Qwen/Qwen2.5-0.5B"]):
        user = load_config([f"model.cache_dir={tmp_path}", *overrides])
        assert not is_built_in(user), overrides
