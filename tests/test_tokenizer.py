"""Tokenizer + chat template: SmolLM2's GGUF tokenizer vs transformers' tokenizer built from the same GGUF."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fp8rl_jax.models.tokenizer import Tokenizer, load_tokenizer

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345 + 678 = 7023; 3.14159e-10, 1,000,000 and 0x1F",
    "Ünïcödé: café naïve Ωμέγα 日本語のテキスト 한국어 ğüşiöç ß",
    "emoji 🙂👍🏽🇫🇷 👨‍👩‍👧 end",
    "  leading spaces\tand\ttabs\n\n\nnewlines    and trailing   ",
    "\n",
    "a\r\nb\r\n",
    "don't I'll we've they'RE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><file_sep>x<|im_end|>",
    "def f(x):\n    return x ** 2  # square\n",
    "",
    "x" * 500,
]

MESSAGES = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 17 * 3?"},
    {"role": "assistant", "content": "17 * 3 = 51."},
    {"role": "user", "content": "And 51 / 3? Réponds en français 🙂"},
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def ref(smollm2_path):
    pytest.importorskip("transformers", reason="needs the [test] extra")
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_encode_matches_transformers(ours, ref):
    for s in STRINGS:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), repr(s)
        assert ours.encode(s, add_special_tokens=True) == ref.encode(s, add_special_tokens=True), repr(s)
    assert ours.encode_batch(STRINGS) == [ref.encode(s, add_special_tokens=False) for s in STRINGS]
    # Special tokens in text are single ids.
    assert ours.encode("<|im_start|>") == [1] and ours.encode("<|im_end|>") == [2]
    # Digits are split one by one (SmolLM2's pre-tokenizer).
    assert len(ours.encode("12345")) == 5


@pytest.mark.slow
def test_decode_matches_transformers(ours, ref):
    for s in STRINGS:
        ids = ref.encode(s, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), repr(s)
        assert ours.decode(np.asarray(ids, dtype=np.int32)) == ref.decode(ids, skip_special_tokens=True)
    batch = [ref.encode(s, add_special_tokens=False) for s in STRINGS]
    assert ours.batch_decode(batch) == ref.batch_decode(batch, skip_special_tokens=True)
    # Round trip of plain text.
    for s in STRINGS:
        if "<|" not in s and "<file_sep>" not in s:
            assert ours.decode(ours.encode(s)) == s


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, ref):
    for msgs in (MESSAGES, MESSAGES[1:], MESSAGES[1:2]):
        for agp in (True, False):
            text = ours.apply_chat_template(msgs, add_generation_prompt=agp)
            assert text == ref.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
            ref_ids = ref.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True)
            ref_ids = ref_ids["input_ids"] if not isinstance(ref_ids, list) else ref_ids
            assert ours.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True) == list(ref_ids)
    text = ours.apply_chat_template(MESSAGES[1:2])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_template_sandbox_helpers_match_transformers(ours, ref):
    import jinja2

    tmpl = ("{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
            "{{ m | tojson }}|{{ {'k': m.content} | tojson(indent=2) }}|{{ bos_token }}{{ eos_token }}\n"
            "{% endfor %}{{ strftime_now('%Y') }}{% if add_generation_prompt %}GO{% endif %}")
    msgs = [{"role": "user", "content": "<b>é\"&'</b>"}, {"role": "skip", "content": "x"}]
    assert ours.apply_chat_template(msgs, chat_template=tmpl) == ref.apply_chat_template(
        msgs, chat_template=tmpl, tokenize=False, add_generation_prompt=True)
    bad = "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}ok"
    with pytest.raises(jinja2.TemplateError, match="only one message"):
        ours.apply_chat_template(msgs, chat_template=bad)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(msgs, chat_template="{{ messages.append(1) }}")


@pytest.mark.slow
def test_special_token_properties(ours, ref):
    assert ours.vocab_size == len(ref) == 49152
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_id == ref.eos_token_id == 2
    assert ours.pad_token_id == ref.pad_token_id == 2
    assert ours.eos_token_ids == (2,)  # <|im_end|> is both EOS and the template's turn end
    assert isinstance(ours.eos_token_ids, tuple)


@pytest.mark.slow
def test_tokenizer_json_round_trip(ours, tmp_path):
    ours.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in cfg["chat_template"]
    again = Tokenizer.from_file(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for s in STRINGS:
        assert again.encode(s) == ours.encode(s), repr(s)
    assert again.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)
    assert (again.eos_token_ids, again.bos_token_id, again.pad_token_id, again.vocab_size) == (
        ours.eos_token_ids, ours.bos_token_id, ours.pad_token_id, ours.vocab_size)
    assert load_tokenizer(tmp_path).encode(STRINGS[4]) == ours.encode(STRINGS[4])
    assert load_tokenizer(tmp_path / "tokenizer.json").chat_template == ours.chat_template


@pytest.mark.slow
def test_saved_tokenizer_loads_in_transformers(ours, ref, tmp_path):
    from transformers import AutoTokenizer

    ours.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for s in STRINGS:
        assert hf.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), repr(s)
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_and_list_form(tmp_path):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers

    tok = HFTok(models.BPE(vocab={"a": 0, "b": 1, "<eos>": 2}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<eos>"}, "chat_template": [{"name": "default", "template": "D{{ eos_token }}"},
                                                            {"name": "tool_use", "template": "T"}]}))
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template([]) == "D<eos>" and t.eos_token_ids == (2,) and t.pad_token_id == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "chat_template.jinja").write_text("J{% for m in messages %}{{ m.content }}{% endfor %}")
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "ab"}]) == "Jab"
    assert t.encode("ab<eos>") == [0, 1, 2] and t.decode([0, 1, 2]) == "ab"
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").chat_template.startswith("J")  # .jinja beside it
    (tmp_path / "chat_template.jinja").unlink()
    no_cfg = Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        no_cfg.apply_chat_template([])


def test_from_gguf_synthetic(tmp_path):
    """Control tokens special, user-defined tokens whole, add_bos_token honoured, merges applied."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    tokens = ["<s>", "</s>", "<think>", "a", "b", "c", "Ġ", "ab", "Ġa", "Ġab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 4, 1, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["Ġ a", "a b", "Ġa b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = load_tokenizer(path)
    assert t.vocab_size == len(tokens)
    assert t.encode("ab ab") == [7, 9]
    assert t.encode("ab ab", add_special_tokens=True) == [0, 7, 9]
    assert t.encode("c<think>c</s>") == [5, 2, 5, 1]
    assert t.decode([0, 7, 2, 9, 1]) == "ab<think> ab"
    assert t.decode([0, 7, 1], skip_special_tokens=False) == "<s>ab</s>"
    assert (t.bos_token_id, t.eos_token_ids, t.pad_token_id) == (0, (1,), 1)
    assert t.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=True) == [7, 1]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="corrupt"):
        load_tokenizer(tmp_path / "broken.gguf")
