"""Chat-message prompts: the rendering shared by the Generator, evaluation, `streamrft eval` and `chat`
equals tokenizer.apply_chat_template, and every way it cannot render is an error naming the row."""

from __future__ import annotations

import json

import pytest

from streamrft.data import DataError, PromptDataset
from streamrft.data.chat import check_chat_setting, prompt_ids, render_prompt

ALPHABET = "0123456789+-*= "


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The tiny chat tokenizer as every loader sees it: saved, then reloaded with AutoTokenizer."""
    from transformers import AutoTokenizer

    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    out = tmp_path_factory.mktemp("chat_tok")
    build_tiny_qwen2(str(out), build_char_tokenizer(str(out), ALPHABET, chat=True), hidden_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, intermediate_size=32)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    from streamrft.models.tiny import build_char_tokenizer

    return build_char_tokenizer(str(tmp_path_factory.mktemp("plain_tok")), ALPHABET)


def test_chat_tokenizer_keeps_the_character_ids_and_appends_role_tokens(chat_tok, plain_tok):
    assert chat_tok.chat_template and not plain_tok.chat_template
    assert [chat_tok.convert_ids_to_tokens(i) for i in range(3)] == ["<pad>", "<eos>", "<unk>"]
    assert chat_tok.encode("12+3=", add_special_tokens=False) == plain_tok.encode("12+3=", add_special_tokens=False)
    n = len(plain_tok)
    assert [chat_tok.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")] == [n, n + 1, n + 2]


def test_rendered_ids_equal_apply_chat_template(chat_tok):
    messages = [{"role": "user", "content": "12+3="}]
    text, ids = prompt_ids(chat_tok, messages)
    assert text == "<|user|>12+3=<eos><|assistant|>"
    assert ids == chat_tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    char = {c: chat_tok.convert_tokens_to_ids(chat_tok.tokenize(c)[0]) for c in "12+3="}
    user, assistant = chat_tok.convert_tokens_to_ids("<|user|>"), chat_tok.convert_tokens_to_ids("<|assistant|>")
    assert ids == [user, char["1"], char["2"], char["+"], char["3"], char["="], chat_tok.eos_token_id, assistant]
    assert chat_tok.decode(ids, skip_special_tokens=True) == "12+3="


def test_system_prompt_is_prepended_unless_the_row_has_one(chat_tok):
    user = [{"role": "user", "content": "1+1="}]
    assert render_prompt(chat_tok, user, system_prompt="2") == "<|system|>2<eos><|user|>1+1=<eos><|assistant|>"
    own = [{"role": "system", "content": "9"}, *user]
    assert render_prompt(chat_tok, own, system_prompt="2") == "<|system|>9<eos><|user|>1+1=<eos><|assistant|>"
    _, ids = prompt_ids(chat_tok, user, system_prompt="2")
    expected = chat_tok.apply_chat_template([{"role": "system", "content": "2"}, *user], add_generation_prompt=True)
    assert ids == expected["input_ids"]


def test_text_prompts_are_used_as_they_are(chat_tok):
    text, ids = prompt_ids(chat_tok, "1+1=")
    assert text == "1+1=" and ids == chat_tok.encode("1+1=", add_special_tokens=False)
    with pytest.raises(DataError, match=r"f.jsonl row 3: the prompt is text but data.system_prompt is set"):
        render_prompt(chat_tok, "1+1=", system_prompt="be brief", loc="f.jsonl row 3")


def test_a_template_file_replaces_the_tokenizers(chat_tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}={% endfor %}")
    check_chat_setting(str(path))
    assert render_prompt(chat_tok, [{"role": "user", "content": "4"}], chat_template=str(path)) == "4="
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad.jinja: line 1: Unexpected end of template"):
        check_chat_setting(str(bad))
    with pytest.raises(ValueError, match=r"data.chat_template='nope.jinja' is not 'auto', 'none' or an existing"):
        check_chat_setting("nope.jinja")


def test_errors_name_the_row(chat_tok, plain_tok):
    messages = [{"role": "user", "content": "1"}]
    with pytest.raises(DataError, match=r"d.jsonl row 2 field 'prompt': the prompt is a list of messages but "
                                        r"data.chat_template=none"):
        render_prompt(chat_tok, messages, chat_template="none", loc="d.jsonl row 2 field 'prompt'")
    with pytest.raises(DataError, match=r"row 5: the prompt is a list of messages but the tokenizer .* has no chat "
                                        r"template; set data.chat_template to a Jinja template file"):
        render_prompt(plain_tok, messages, loc="row 5")
    with pytest.raises(DataError, match=r"row 7: the chat template cannot render .*role tool is not system, user"):
        render_prompt(chat_tok, [{"role": "tool", "content": "1"}], loc="row 7")
    with pytest.raises(DataError, match=r"row 1: message 0 must be an object with 'role' and 'content'"):
        render_prompt(chat_tok, [{"content": "1"}], loc="row 1")


def test_dataset_keeps_messages_and_refuses_them_with_chat_template_none(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "reference": "2"}, {"prompt": "2+2=", "reference": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(path)
    assert ds[0].prompt == rows[0]["prompt"] and ds[1].prompt == "2+2="
    with pytest.raises(DataError, match=r"d.jsonl: row 0 field 'prompt': the prompt is a list of messages but "
                                        r"data.chat_template=none"):
        PromptDataset(path, chat_template="none")
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": 3}], "reference": "2"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: row 0 field 'prompt': message 0 has role str and content int"):
        PromptDataset(path)


def test_config_check_needs_a_template_for_message_rows_before_the_model_loads(tmp_path, plain_tok):
    from streamrft.config import ConfigError, load_config
    from streamrft.config.validate import validate_data

    from streamrft.models.tiny import build_tiny_qwen2

    model = tmp_path / "m"
    build_tiny_qwen2(str(model), plain_tok, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=32)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "reference": "2"}) + "\n")
    cfg = load_config(None, [f"model.path={model}", f"data.train_path={data}"])
    with pytest.raises(ConfigError, match=r"row 0 field 'prompt' is a list of messages, but the tokenizer of "
                                          r"model.path=.* has no chat template"):
        validate_data(cfg)
    cfg = load_config(None, [f"model.path={model}", f"data.train_path={data}", "data.image_field=image"])
    with pytest.raises(ConfigError, match=r"row 0 field 'prompt' is a list of messages, which take their media as "
                                          r"content parts \(\{'type': 'image', 'image': PATH\}, \.\.\.\), not "
                                          r"data.image_field; clear data.image_field or give the prompts as text"):
        validate_data(cfg)
    cfg = load_config(None, [f"model.path={model}", f"data.train_path={data}", "data.chat_template=none",
                             "data.system_prompt=x"])
    with pytest.raises(ConfigError, match=r"data.system_prompt is set but data.chat_template=none"):
        validate_data(cfg)


@pytest.fixture(scope="module")
def chat_model_dir(chat_tok):
    return chat_tok.name_or_path


def test_streamrft_eval_renders_message_prompts_like_training(chat_model_dir, chat_tok, tmp_path, monkeypatch):
    from streamrft.engines.hf import HFEngine
    from streamrft.evaluate.config import load_eval_config, validate_eval_config
    from streamrft.evaluate.run import evaluate

    rows = [{"q": [{"role": "user", "content": "1+1="}], "gt": {"answer": "2"}},
            {"q": [{"role": "user", "content": "2+3="}], "gt": {"answer": "5"}}]
    data = tmp_path / "bench.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list[list[int]] = []
    original = HFEngine.generate_all

    async def recording(self, requests, *args, **kwargs):
        seen.extend(r.prompt_ids for r in requests)
        return await original(self, requests, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate_all", recording)
    cfg = load_eval_config(None, [f"model_path={chat_model_dir}", f"data_path={data}", "prompt_key=q",
                                  "reference_key=gt.answer", "format=arith", "n=1", "k=1", "max_new_tokens=2",
                                  "system_prompt=1+0", f"output_path={tmp_path / 'out.jsonl'}"])
    validate_eval_config(cfg)
    summary = evaluate(cfg)
    assert summary["n_problems"] == 2
    expected = [chat_tok.apply_chat_template([{"role": "system", "content": "1+0"}, *r["q"]],
                                             add_generation_prompt=True)["input_ids"] for r in rows]
    assert seen == expected
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["reference"] for o in out] == ["2", "5"] and out[0]["prompt"] == rows[0]["q"]


def test_streamrft_chat_refuses_a_system_prompt_without_a_template(tmp_path, plain_tok, capsys):
    from streamrft.chat import chat_main
    from streamrft.models.tiny import build_tiny_qwen2

    model = tmp_path / "m"
    build_tiny_qwen2(str(model), plain_tok, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=32)
    assert chat_main([str(model), "--system-prompt", "x"]) == 2
    assert "--system-prompt needs a chat template" in capsys.readouterr().err
    assert chat_main([str(model), "--chat-template", "missing.jinja"]) == 2
    assert "--chat-template='missing.jinja' is not 'auto', 'none' or an existing" in capsys.readouterr().err
