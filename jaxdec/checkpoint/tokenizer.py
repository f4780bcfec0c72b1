"""Tokenizers from GGUF metadata or Hugging Face files, chat templates, streaming decode.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, merges, token types and
special ids under llama.cpp's `tokenizer.ggml.*` keys, plus a `pre` name that selects the
pre-tokenization regexes. `Tokenizer.from_gguf` rebuilds an HF `tokenizers.Tokenizer`
from those, splitting text with exactly the regexes llama.cpp uses for that `pre` name
(applied one after another, each match and each gap kept as its own piece, as
llama.cpp's `unicode_regex_split` does), then byte-level BPE.

Gemma's SentencePiece vocabulary (`tokenizer.ggml.model` "llama") is rebuilt as HF's GGUF
converter builds it: spaces become "▁", then BPE with byte fallback over merges derived from
the vocabulary (the file lists none), ranked by the merged token's index.

`Tokenizer.save` / `Tokenizer.load` write and read `tokenizer.json` +
`tokenizer_config.json`, the same files `from_hf_dir` reads, so a converted checkpoint
carries its tokenizer and chat template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from jaxdec.errors import JaxdecError

# llama.cpp token types (gguf.TokenType): only these two are matched whole in raw text.
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> the regexes llama.cpp (llama-vocab.cpp) splits text with, in order.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging for these.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})

# Chat-turn terminators that end generation when the vocabulary has them as special tokens.
_TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
              "<end_of_turn>", "<|end|>")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves,
    the other 68 bytes to U+0100.. in byte order, so every byte string is a printable string."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_PAD = re.compile(r"\[PAD\d+\]")


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _piece(token: str, byte_level: bool) -> bytes | None:
    """The bytes a plain token spells: GPT-2's byte alphabet, or SentencePiece's '▁' and
    <0xAB> byte-fallback tokens."""
    if _PAD.fullmatch(token):
        return None
    if byte_level:
        table = _char_to_byte()
        return bytes(table[c] for c in token) if all(c in table for c in token) else None
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


@functools.lru_cache(maxsize=8)
def token_pieces(tokenizer: "Tokenizer", rows: int | None = None) -> tuple[bytes | None, ...]:
    """The bytes each of the first `rows` ids (default: the vocabulary) spells: part of a
    character for a byte-level or byte-fallback token, an added token's own text, None for
    padding and ids past the vocabulary. (A tokenizer's `decode` of one id cannot say this:
    half a character decodes to U+FFFD.)"""
    backend = tokenizer.backend
    rows = tokenizer.vocab_size if rows is None else rows
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    byte_level = "ByteLevel" in str(backend.decoder)
    pieces = [None] * rows
    for token, i in backend.get_vocab(with_added_tokens=False).items():
        if i < rows and i not in added:
            pieces[i] = _piece(token, byte_level)
    for i, content in added.items():
        if i < rows:
            pieces[i] = content.encode("utf-8")
    return tuple(pieces)


def _respell(token: str) -> str:
    """A token stored as raw text, written in the byte-level alphabet (as the vocab needs)."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def _gguf_tokenizer_metadata(source: Any) -> Mapping[str, Any]:
    """`tokenizer.*` metadata and the architecture from a `gguf.GGUFReader` or an
    already-parsed key -> value map."""
    if isinstance(source, Mapping):
        return source
    fields = getattr(source, "fields", None)
    if fields is None:
        raise TypeError(f"expected a gguf.GGUFReader or a metadata mapping, got {type(source)}")
    return {k: f.contents() for k, f in fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}


def _byte_level_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                    splits: tuple[str, ...], *, ignore_merges: bool) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer whose ids equal the GGUF vocabulary's indices.

    Control tokens become special added tokens and user-defined ones plain added tokens,
    both matched whole before pre-tokenization and kept under their raw spelling. Any other
    token not written in the byte alphabet is respelled into it (its UTF-8 bytes).
    """
    alphabet = set(bytes_to_unicode().values())
    whole = {i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)}
    vocab = {(tok if i in whole or set(tok) <= alphabet else _respell(tok)): i
             for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
    except Exception as e:  # the Rust side reports a merge naming a token not in the vocab
        raise JaxdecError(f"GGUF tokenizer vocabulary/merges are inconsistent: "
                          f"{str(e).splitlines()[0]}") from None
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(whole) if types[i] == _CONTROL])
    tok.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                    for i in sorted(whole) if types[i] == _USER_DEFINED])
    wrong = [i for i in whole if tok.token_to_id(tokens[i]) != i]
    if wrong:
        raise JaxdecError(f"GGUF tokenizer: added token {tokens[wrong[0]]!r} (id {wrong[0]}) "
                          "is duplicated in the vocabulary")
    return tok


def _gemma_sentencepiece(tokens: Sequence[str], types: Sequence[int]) -> tokenizers.Tokenizer:
    """Gemma's SentencePiece BPE, as HF's GGUF converter builds it (ids = vocabulary indices).

    Tokens of two or more spaces are stored as spaces but looked up as "▁"s. The merges are
    every split of a token into two vocabulary tokens, by the token's index (a lower index
    merges first), then the longer left part first. Control tokens are special added tokens,
    user-defined ones (newline runs) plain added tokens: both are matched whole.
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [(t[:j], t[j:]) for t in vocab for j in range(len(t) - 1, 0, -1)
              if t[:j] in vocab and t[j:] in vocab]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                          fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab])
    return tok


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    """The id of a tokenizer_config.json special token (a string or {"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JaxdecError(f"{path}: cannot read JSON ({str(e).splitlines()[0]})") from None


def _hf_chat_template(path: pathlib.Path, config: dict[str, Any]) -> str | None:
    """The chat template from chat_template.jinja, chat_template.json or tokenizer_config.json."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    return with_special[:1] == [bos_id] and backend.encode("a", add_special_tokens=False).ids[:1] != [bos_id]


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the checkpoint's special ids, BOS policy and chat template.

    Invariants: ids are the checkpoint's ids (`backend` vocabulary, added tokens included,
    indexes the model's embedding rows); the backend adds no special tokens itself
    (`encode` prepends BOS iff `add_bos` and `add_special_tokens`).
    """

    backend: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """From a `gguf.GGUFReader` (or a mapping of its parsed metadata values). A Gemma 3
        file without a chat template gets Gemma's (`chat_template.GEMMA3`).

        Raises JaxdecError for a tokenizer model or `pre` name this module cannot rebuild.
        """
        meta = _gguf_tokenizer_metadata(source)
        model = meta.get("tokenizer.ggml.model")
        gemma = model == "llama" and meta.get("general.architecture") == "gemma3"
        if model != "gpt2" and not gemma:
            raise JaxdecError(f"unsupported GGUF tokenizer model {model!r} "
                              "(supported: 'gpt2', byte-level BPE; 'llama' for Gemma 3)")
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if not gemma and pre not in _PRE_SPLITS:
            raise JaxdecError(f"unsupported GGUF pre-tokenizer {pre!r} "
                              f"(supported: {', '.join(sorted(_PRE_SPLITS))})")
        tokens = list(meta.get("tokenizer.ggml.tokens") or ())
        if not tokens:
            raise JaxdecError("GGUF file has no tokenizer.ggml.tokens")
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
        template = meta.get("tokenizer.chat_template")
        if gemma:
            backend = _gemma_sentencepiece(tokens, types)
            if template is None:  # Gemma files carry none: Gemma's own
                from jaxdec.checkpoint import chat_template
                template = chat_template.GEMMA3
        else:
            backend = _byte_level_bpe(tokens, types, list(meta.get("tokenizer.ggml.merges") or ()),
                                      _PRE_SPLITS[pre], ignore_merges=pre in _IGNORE_MERGES)
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        ids = {k: (int(v) if v is not None and 0 <= int(v) < len(tokens) else None)
               for k, v in ids.items()}
        return cls(backend=backend, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["padding"],
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=template)

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """From `tokenizer.json` + optional `tokenizer_config.json` (and chat_template.jinja)."""
        path = pathlib.Path(path)
        if not (path / "tokenizer.json").is_file():
            raise JaxdecError(f"{path}: no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust parser raises plain Exception
            raise JaxdecError(f"{path / 'tokenizer.json'}: cannot parse "
                              f"({(str(e).splitlines() or ['?'])[0]})") from None
        config = _read_json(path / "tokenizer_config.json") \
            if (path / "tokenizer_config.json").is_file() else {}
        bos = _token_id(backend, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        return cls(backend=backend, bos_id=bos, eos_id=_token_id(backend, config.get("eos_token")),
                   pad_id=_token_id(backend, config.get("pad_token")),
                   add_bos=bool(add_bos) if add_bos is not None
                   else _post_processor_adds_bos(backend, bos),
                   chat_template=_hf_chat_template(path, config))

    load = from_hf_dir

    def save(self, path: str | pathlib.Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` into `path` (created if needed)."""
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_str(self.bos_id),
            "eos_token": self._token_str(self.eos_id),
            "pad_token": self._token_str(self.pad_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(
            json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")

    # ---- encode / decode ----------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special/added tokens in `text` are matched whole. BOS only if `add_bos`."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        encoded = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids) if add_special_tokens else e.ids for e in encoded]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = True) -> "StreamDecoder":
        """A fresh incremental detokenizer for this tokenizer."""
        return StreamDecoder(tokenizer=self, skip_special_tokens=skip_special_tokens)

    # ---- metadata -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """EOS, then each chat-turn terminator the vocabulary has as a special token."""
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ends = [self.backend.token_to_id(t) for t in _TURN_ENDS]
        ids = [self.eos_id] + [i for i in ends if i in special]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` as HF's `apply_chat_template(..., tokenize=False)` does."""
        if not self.chat_template:
            raise JaxdecError("this checkpoint has no chat template")
        context = {"tools": None, "documents": None, **kwargs,
                   "bos_token": self._token_str(self.bos_id) or "",
                   "eos_token": self._token_str(self.eos_id) or "",
                   "pad_token": self._token_str(self.pad_id) or ""}
        from jaxdec.checkpoint import chat_template

        return chat_template.render(self.chat_template, messages=messages,
                                    add_generation_prompt=add_generation_prompt, **context)

    def _with_bos(self, ids: list[int]) -> list[int]:
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def _token_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


def stream_step(tokenizer: Tokenizer, window: tuple[int, ...], emitted: int, *,
                skip_special_tokens: bool = True, force: bool = False
                ) -> tuple[tuple[int, ...], int, str]:
    """One step of incremental detokenization, as a pure function.

    `window` holds the ids of the last emitted chunk (left context, for decoders that treat
    a first token specially) followed by ids not yet emitted; `emitted` is how many of
    `window` were emitted. Returns the next `(window, emitted)` and the newly completed
    text. Text is released only when it does not end in U+FFFD, so never half a UTF-8
    character, unless `force` (end of stream). Because each release ends on a character
    boundary, byte-level decoding of the whole stream splits exactly at the releases.
    """
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    done, full = decode(window[:emitted]), decode(window)
    if len(full) <= len(done) or (full.endswith("\ufffd") and not force):
        return window, emitted, ""
    rest = window[emitted:]
    return rest, len(rest), full[len(done):]


class StreamDecoder:
    """Incremental detokenizer for printing generated ids: `put` one id, get the text it
    completes ('' while a character is still incomplete); `flush` at the end.

    Invariant: `"".join(put outputs) + flush()` equals `tokenizer.decode(all_ids)`. The
    only mutable object in this module (it is host-side terminal IO); the logic is the
    pure `stream_step`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._window: tuple[int, ...] = ()
        self._emitted = 0

    def put(self, token_id: int) -> str:
        return self._step((*self._window, int(token_id)), force=False)

    def flush(self) -> str:
        return self._step(self._window, force=True)

    def _step(self, window: tuple[int, ...], *, force: bool) -> str:
        self._window, self._emitted, text = stream_step(
            self.tokenizer, window, self._emitted,
            skip_special_tokens=self.skip_special_tokens, force=force)
        return text
