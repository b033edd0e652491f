"""Tokenizer and chat template without transformers: the ``tokenizers`` library plus a jinja2 sandbox.

Sources: an HF ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template and special tokens), or
the tokenizer metadata inside a llama.cpp GGUF file (``tokenizer.ggml.*``, byte-level BPE ``gpt2`` model).
Chat templates render exactly as transformers' ``apply_chat_template`` does: a jinja2
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols`` extension,
a ``tojson`` filter that does not HTML-escape (``ensure_ascii=False``), the globals ``raise_exception`` and
``strftime_now``, the special-token strings (``bos_token``, ``eos_token``, ...) as variables, and a no-op
``{% generation %}`` block tag.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

# llama.cpp token types (gguf-py ``TokenType``).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre`` (the regexes llama.cpp's llama-vocab.cpp uses for
# these pre-tokenizer types, which are those of the models' own tokenizer.json files).
_GPT2_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}

# End-of-turn markers that chat templates close an assistant message with.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    """Compile a chat template in the sandbox transformers uses (see module docstring)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body unchanged (assistant-mask marker)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _token_str(v: Any) -> str | None:
    """A special token entry of tokenizer_config.json (string or AddedToken dict) as its string."""
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


class Tokenizer:
    """A fast (Rust) tokenizer with its special tokens and chat template.

    Build with :meth:`from_file`, :meth:`from_gguf` or :func:`load_tokenizer`. Ids are Python ints.

    Attributes:
      chat_template: jinja2 chat template string or None.
      bos_token, eos_token, pad_token, unk_token: special-token strings or None.
      add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends BOS (GGUF files); for
        ``tokenizer.json`` this is whatever its post-processor does.
    """

    def __init__(self, tokenizer: _HFTokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool = False):
        """Wrap a ``tokenizers.Tokenizer``; special tokens are given as strings present in its vocabulary."""
        self._tok = tokenizer
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        for name, tok in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token), ("unk", unk_token)):
            if tok is not None and tokenizer.token_to_id(tok) is None:
                raise ValueError(f"{name}_token {tok!r} is not in the vocabulary")
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_file(cls, tokenizer_json_path: str | os.PathLike,
                  tokenizer_config_path: str | os.PathLike | None = None) -> "Tokenizer":
        """Load an HF ``tokenizer.json``; special tokens and chat template from ``tokenizer_config.json``.

        ``chat_template`` may be a string or transformers' list-of-``{name, template}`` form ("default" is
        taken); when the config has none, a ``chat_template.jinja`` beside it (transformers 5 layout) is used.

        Raises:
          FileNotFoundError: a given path does not exist. ValueError: unreadable/corrupt JSON.
        """
        path = os.fspath(tokenizer_json_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:
            raise ValueError(f"corrupt tokenizer file {path}: {e}") from e
        cfg: dict[str, Any] = {}
        folder = os.path.dirname(path)
        if tokenizer_config_path is not None:
            cpath = os.fspath(tokenizer_config_path)
            if not os.path.isfile(cpath):
                raise FileNotFoundError(f"tokenizer_config.json not found: {cpath}")
            try:
                with open(cpath, encoding="utf-8") as f:
                    cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"corrupt tokenizer config {cpath}: {e}") from e
            folder = os.path.dirname(cpath)
        template = cfg.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        return cls(tok, chat_template=template, bos_token=_token_str(cfg.get("bos_token")),
                   eos_token=_token_str(cfg.get("eos_token")), pad_token=_token_str(cfg.get("pad_token")),
                   unk_token=_token_str(cfg.get("unk_token")), add_bos_token=bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.model == "gpt2"``: byte-level BPE).

        Vocabulary from ``tokenizer.ggml.tokens`` (id = position), merges from ``tokenizer.ggml.merges``;
        tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so both are
        matched whole. The pre-tokenizer follows ``tokenizer.ggml.pre`` (digit-splitting GPT-2 regex for
        ``smollm``/``starcoder``..., Qwen2 and Llama-3 split regexes, GPT-2 otherwise); chat template from
        ``tokenizer.chat_template``; bos/eos/pad/unk from ``tokenizer.ggml.*_token_id``; BOS is prepended by
        ``encode(add_special_tokens=True)`` when ``tokenizer.ggml.add_bos_token`` is true.

        Raises:
          FileNotFoundError: missing file. ValueError: corrupt file, no tokenizer metadata, or a tokenizer
            model other than ``gpt2`` (named).
        """
        from fp8rl_jax.models.gguf_io import read_gguf_metadata

        path = os.fspath(path)
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"GGUF file {path} has no tokenizer metadata (tokenizer.ggml.model/tokens)")
        if kind != "gpt2":
            raise ValueError(f"GGUF file {path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        alphabet = set(_bytes_to_unicode().values())
        b2u = _bytes_to_unicode()
        vocab: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty == _NORMAL and not set(t) <= alphabet:  # a raw-text spelling: respell in the byte alphabet
                t = "".join(b2u[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False,
                                      ignore_merges=meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3", "llama-v3")))
        pre = meta.get("tokenizer.ggml.pre")
        if pre in _GPT2_DIGITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            if pre in ("qwen2", "deepseek-r1-qwen"):
                tok.normalizer = normalizers.NFC()
        else:
            if pre not in (None, "default", "gpt-2", "gpt2"):
                warnings.warn(f"GGUF pre-tokenizer type {pre!r} is not known here; using GPT-2 byte-level splitting")
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty == _CONTROL and t in vocab]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                if ty == _USER_DEFINED and t in vocab]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)

        def name(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos = name("bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
        if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
            warnings.warn(f"GGUF tokenizer of {path}: {len(tokens)} listed tokens but the built vocabulary has "
                          f"{tok.get_vocab_size(with_added_tokens=True)} ids (duplicate token strings?)")
        return cls(tok, chat_template=meta.get("tokenizer.chat_template"), bos_token=bos,
                   eos_token=name("eos_token_id"), pad_token=name("padding_token_id"),
                   unk_token=name("unknown_token_id"), add_bos_token=add_bos)

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) to a folder
        (created if needed), loadable by :meth:`from_file` / :func:`load_tokenizer` and by transformers."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
               "unk_token": self.unk_token, "add_bos_token": self.add_bos_token,
               "chat_template": self.chat_template, "clean_up_tokenization_spaces": False,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)

    # -------------------------------------------------------------------------------------- encode/decode

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (e.g. ``<|im_start|>``) map to their ids.

        ``add_special_tokens=True`` applies the tokenizer's post-processor (e.g. prepend BOS); the default
        False is what chat-templated prompts need (the template already wrote the special tokens).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` for a list of strings (parallel in Rust)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ints or a 1-D integer array); special tokens dropped when ``skip_special_tokens``.

        Invalid UTF-8 byte sequences (a token cut mid-character) decode to U+FFFD, as in transformers.
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` for each sequence of ids."""
        return self._tok.decode_batch([[int(i) for i in s] for s in sequences], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (vocabulary spelling), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string (vocabulary spelling) of an id, or None."""
        return self._tok.id_to_token(int(token_id))

    # --------------------------------------------------------------------------------------- chat template

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, *, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render a conversation with the chat template, like transformers' ``apply_chat_template``.

        Args:
          messages: ``[{"role": ..., "content": ...}, ...]``.
          add_generation_prompt: append the assistant turn header (e.g. ``<|im_start|>assistant\\n``).
          tokenize: return ids (encoded without adding special tokens, as transformers does) instead of text.
          tools, documents, **kwargs: extra template variables (kwargs override the special-token strings
            ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` that are always provided).
          chat_template: use this template instead of the tokenizer's.

        Raises:
          ValueError: no chat template. jinja2.TemplateError: the template called ``raise_exception``.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=... or load a tokenizer "
                             "whose tokenizer_config.json / GGUF metadata has one")
        variables = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                       ("pad_token", self.pad_token), ("unk_token", self.unk_token)) if v is not None}
        variables.update(kwargs)
        text = _compile_template(template).render(messages=list(messages), tools=tools, documents=documents,
                                                   add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ------------------------------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None."""
        return self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS token first, then the chat template's end-of-turn token
        (``<|im_end|>``, ``<|eot_id|>``, ...) when the template uses it and it is in the vocabulary."""
        ids: list[int] = []
        if self.eos_token is not None:
            ids.append(self._tok.token_to_id(self.eos_token))
        for t in _TURN_END_TOKENS:
            if self.chat_template and t in self.chat_template:
                i = self._tok.token_to_id(t)
                if i is not None and i not in ids:
                    ids.append(i)
        return tuple(ids)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the EOS token, or None."""
        return self._tok.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of the PAD token; when none is defined, the first of :attr:`eos_token_ids` (or None)."""
        if self.pad_token is not None:
            return self._tok.token_to_id(self.pad_token)
        eos = self.eos_token_ids
        return eos[0] if eos else None

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"pad={self.pad_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from an HF folder (``tokenizer.json`` [+ ``tokenizer_config.json``]), a
    ``tokenizer.json`` file, a ``.gguf`` file, or a folder holding exactly one ``.gguf`` file.

    Raises:
      FileNotFoundError: the path does not exist, or the folder has neither ``tokenizer.json`` nor a single
        ``.gguf`` (the message lists what was looked for).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        cfg = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        return Tokenizer.from_file(path, cfg if os.path.isfile(cfg) else None)
    if os.path.isdir(path):
        tj = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tj):
            cfg = os.path.join(path, "tokenizer_config.json")
            return Tokenizer.from_file(tj, cfg if os.path.isfile(cfg) else None)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return Tokenizer.from_gguf(os.path.join(path, ggufs[0]))
        raise FileNotFoundError(f"no tokenizer in {path}: expected tokenizer.json or exactly one .gguf file "
                                f"(found {len(ggufs)} .gguf files)")
    raise FileNotFoundError(f"tokenizer path not found: {path} (expected an HF folder with tokenizer.json, "
                            f"a tokenizer.json file or a .gguf file)")
