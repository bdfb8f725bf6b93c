"""Loading a model's tokenizer and naming its control tokens.

Owns: the per-path tokenizer cache (in memory, and on disk for GGUF files: converting a GGUF
vocabulary takes seconds, reloading the converted tokenizer a fraction of one), the rule for
which added tokens are *control* tokens (the ones a user's text must never produce), and the
text-only encoder that tokenizes a string with every control token switched off. Nothing here
fetches from a model hub.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import uuid
from pathlib import Path
from typing import NamedTuple

from tokenizers import AddedToken, Tokenizer

from duplex.kernels import switches

# Tokens that close a turn in common chat formats; one counts as an end token of a model when it
# is one of the tokenizer's added tokens and its chat template writes it.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                   "<|end_of_turn|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<|return|>",
                   "<|call|>", "<｜end▁of▁sentence｜>")

# An added token that looks like markup (`<tool_call>`, `<|im_start|>`, `[INST]`) is a control
# token even when the tokenizer does not flag it special: Qwen's `<tool_call>` is such a token.
_MARKUP = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")
_CACHE_LAYOUT = "2"   # bump when what goes into a cached tokenizer directory changes
log = logging.getLogger(__name__)


def load_tokenizer(model_path: str):
    """The transformers fast tokenizer of a local GGUF file or Hugging Face directory (cached)."""
    return _load_tokenizer(os.path.realpath(model_path))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    if os.path.isfile(path) and path.endswith(".gguf"):
        tokenizer = _load_gguf(path)
    elif os.path.isdir(path):
        from transformers import AutoTokenizer  # heavy (imports torch), paid once

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    else:
        raise FileNotFoundError(f"no GGUF file or tokenizer directory at {path!r}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{path!r} has no fast (tokenizer.json) tokenizer; Duplex needs one")
    return tokenizer


def _load_gguf(path: str):
    cached = _gguf_cache_dir(path)
    if cached is not None and (cached / "verified").is_file():
        try:
            return _load_saved(cached)
        except Exception as error:  # a damaged cache entry is a miss
            log.warning("ignoring tokenizer cache %s: %s", cached, error)
    tokenizer = _convert_gguf(path)
    if cached is not None:
        _store_in_cache(tokenizer, cached)
    return tokenizer


def _convert_gguf(path: str):
    """The file's tokenizer as transformers converts it. AutoTokenizer first builds a model
    config from the file and refuses architectures transformers cannot load as models
    (deepseek2: "GGUF model with architecture deepseek2 is not supported yet."); the
    tokenizer itself reads only the tokenizer.* entries, so those files load through the
    fast tokenizer class directly."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where = dict(gguf_file=os.path.basename(path), local_files_only=True)
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path), **where)
    except ValueError as error:
        if "is not supported yet" not in str(error):
            raise
        log.info("%s: %s; loading its tokenizer alone", path, error)
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), **where)


def _gguf_cache_dir(path: str) -> Path | None:
    """Where the converted tokenizer of a GGUF file is kept, keyed by what the conversion
    reads (the architecture and every tokenizer.* entry, hashed by the GGUF reader) and the
    transformers version: the quantizations of one model share one entry. None when caching
    is off (DUPLEX_TOKENIZER_CACHE=0)."""
    if switches.is_off("DUPLEX_TOKENIZER_CACHE"):
        return None
    import transformers

    from duplex.engine.models.gguf_reader import read_gguf

    digest = read_gguf(path).tokenizer_digest
    key = f"{_CACHE_LAYOUT}|{digest}|{transformers.__version__}"
    root = Path(switches.value("DUPLEX_CACHE_DIR") or Path.home() / ".cache" / "duplex")
    return root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _store_in_cache(tokenizer, cached: Path) -> None:
    """Save, reload and compare; publish by rename only an entry that reloads identically."""
    staging = cached.parent / f".staging-{uuid.uuid4().hex}"
    try:
        tokenizer.save_pretrained(staging)
        reloaded = _load_saved(staging)
        if _fingerprint(reloaded) != _fingerprint(tokenizer):
            log.warning("not caching the tokenizer of %s: it does not reload identically", cached)
            return
        (staging / "verified").write_text("ok\n")
        os.replace(staging, cached)
    except OSError as error:   # read-only home, a concurrent writer won the rename, ...
        log.info("tokenizer cache not written (%s)", error)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load_saved(directory: Path):
    """A saved tokenizer directory; the plain tokenizers backend loads without importing torch."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _fingerprint(tokenizer) -> tuple:
    added = {i: (t.content, t.special, t.lstrip, t.rstrip, t.single_word, t.normalized)
             for i, t in tokenizer.added_tokens_decoder.items()}
    return (tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template, added,
            tokenizer.special_tokens_map, tokenizer("a b")["input_ids"])


def chat_template(tokenizer) -> str:
    """The tokenizer's default chat template; ValueError when the model ships none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        raise ValueError("the model has no chat template; pass one explicitly")
    return template


def control_tokens(tokenizer) -> dict[str, int]:
    """Control token text → id: every special token, plus added tokens that look like markup."""
    tokens = {text: token_id for text, token_id in
              zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if text}
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if token.special or _MARKUP.fullmatch(token.content.strip() or " "):
            tokens[token.content] = token_id
    return tokens


def special_token_ids(tokenizer) -> set[int]:
    """Ids of all control tokens (see `control_tokens`)."""
    return set(control_tokens(tokenizer).values())


def eos_token_ids(tokenizer, model_path: str | None = None) -> list[int]:
    """Ids that end generation: eos, turn-end tokens the chat template writes, and for a
    Hugging Face directory the `eos_token_id` of its generation_config.json."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += _generation_config_eos(model_path)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(template.values())
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
    ids += [added[text] for text in TURN_END_TOKENS if text in added and text in template]
    return list(dict.fromkeys(ids))


def _generation_config_eos(model_path: str | None) -> list[int]:
    if not model_path or not os.path.isdir(model_path):
        return []
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(token_id) for token_id in eos]


class TextEncoder(NamedTuple):
    """Encodes text with every control token switched off (non-control added tokens still
    match, as they do for transformers). `at_start` says whether the text begins the prompt:
    a SentencePiece pre-tokenizer adds its prefix space only there."""
    first: Tokenizer
    rest: Tokenizer

    def encode(self, text: str, at_start: bool):
        return (self.first if at_start else self.rest).encode(text, add_special_tokens=False)


def text_encoder(tokenizer) -> TextEncoder:
    """A `TextEncoder` for a transformers fast tokenizer."""
    backend = tokenizer.backend_tokenizer
    control = set(control_tokens(tokenizer))
    kept = [token for token in tokenizer.added_tokens_decoder.values()
            if token.content not in control]
    first = _text_only(backend, control, kept, backend.pre_tokenizer)
    rest_pre = _without_first_prefix(backend)
    rest = first if rest_pre is None else _text_only(backend, control, kept, rest_pre)
    return TextEncoder(first, rest)


def _text_only(backend: Tokenizer, control: set[str], kept: list, pre_tokenizer) -> Tokenizer:
    """The backend without its control tokens. Cheap path: share the model and re-add the kept
    added tokens. When their ids come out different, copy the tokenizer through JSON with each
    control token renamed to an unguessable string, which keeps every id in place."""
    plain = Tokenizer(backend.model)
    plain.normalizer = backend.normalizer
    plain.add_tokens([AddedToken(token.content, single_word=token.single_word,
                                 lstrip=token.lstrip, rstrip=token.rstrip,
                                 normalized=token.normalized, special=False) for token in kept])
    if not _same_ids(plain, backend, kept):
        spec = json.loads(backend.to_str())
        disabled = f"\ue000disabled-{secrets.token_hex(8)}-"
        for token in spec["added_tokens"]:
            if token["content"] in control:
                token["content"] = f"{disabled}{token['id']}"
        spec["truncation"] = spec["padding"] = None
        plain = Tokenizer.from_str(json.dumps(spec))
        if not _same_ids(plain, backend, kept):
            raise ValueError("cannot build a text-only copy of this tokenizer")
    plain.pre_tokenizer = pre_tokenizer
    return plain


def _same_ids(plain: Tokenizer, backend: Tokenizer, kept: list) -> bool:
    return all(plain.token_to_id(t.content) == backend.token_to_id(t.content) for t in kept)


def _without_first_prefix(backend: Tokenizer):
    """The pre-tokenizer for text that does not begin the prompt: a Metaspace whose prefix
    scheme is "first" becomes "never". None when nothing needs to change."""
    if backend.pre_tokenizer is None:
        return None
    spec = json.loads(backend.pre_tokenizer.__getstate__())
    return _pre_tokenizer_from_spec(spec) if _set_never(spec) else None


def _set_never(node) -> bool:
    changed = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            changed = True
        for child in node.get("pretokenizers", []):
            changed |= _set_never(child)
    return changed


def _pre_tokenizer_from_spec(spec: dict):
    # The tokenizers package builds components from JSON only through a whole tokenizer.
    shell = Tokenizer.from_str(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": spec, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}))
    return shell.pre_tokenizer
