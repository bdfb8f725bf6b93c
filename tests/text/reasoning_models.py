"""Tokenizers of reasoning models built locally (no hub): the default vocabulary plus the
think markers and a model's special tokens, with the real chat template of
DeepSeek-R1-Distill-Qwen or Qwen3 (shipped in tests/text/templates)."""
import json
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
R1_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")


def reasoning_template(name: str) -> str:
    """The chat template text of `deepseek_r1_distill_qwen` or `qwen3`."""
    return (TEMPLATES / (name + ".jinja")).read_text(encoding="utf-8")


def write_reasoning_tokenizer(directory: Path, default_tokenizer, template: str,
                              think_special: bool, extra_special: tuple[str, ...] = (),
                              eos: str = "<|im_end|>", bos: str | None = None) -> str:
    """A local tokenizer directory: the default vocabulary plus `<think>`/`</think>` (special
    or not, as `think_special` says) and `extra_special` tokens, with `template`."""
    spec = json.loads(default_tokenizer.backend_tokenizer.to_str())
    next_id = max(token["id"] for token in spec["added_tokens"]) + 1
    next_id = max(next_id, len(spec["model"]["vocab"]))
    added = [(t, True) for t in extra_special] + [(t, think_special)
                                                  for t in ("<think>", "</think>")]
    for offset, (content, special) in enumerate(added):
        spec["added_tokens"].append({"id": next_id + offset, "content": content,
                                     "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False, "special": special})
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "unk_token": "<|endoftext|>"}))
    return str(directory)


def r1_tokenizer_dir(directory: Path, default_tokenizer) -> str:
    """DeepSeek-R1-Distill-Qwen: `<think>` plain added tokens, as in its tokenizer."""
    return write_reasoning_tokenizer(directory, default_tokenizer,
                                     reasoning_template("deepseek_r1_distill_qwen"),
                                     think_special=False, extra_special=R1_SPECIAL,
                                     eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>")


def qwen3_tokenizer_dir(directory: Path, default_tokenizer, think_special: bool = False) -> str:
    return write_reasoning_tokenizer(directory, default_tokenizer, reasoning_template("qwen3"),
                                     think_special=think_special)
