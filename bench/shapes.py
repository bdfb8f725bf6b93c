"""Random-weight GGUF files of real model shapes, for measuring at the sizes people run.

`write_gguf(shape, path)` writes a Llama-architecture model of that shape in F16 (norms F32)
with random weights (normal, std 0.02), the tensors streamed to the file one at a time so an
8B shape needs no 16 GB of RAM; its tokenizer and chat template are the default model's
(SmolLM2's 49,152-token vocabulary, so embedding and output are smaller than the real
models' 128,256 rows: ~0.4 B parameters fewer at 8B). `quantize(f16, quant, bin_dir)` runs
llama.cpp's own `llama-quantize` on it (`cmake --build build --target llama-quantize` in the
tree the anchor script builds), which is how the files people download are made.

    shape   like             layers  hidden  heads / kv  ffn     tied output
    1b      Llama-3.2-1B     16      2048    32 / 8      8192    yes
    3b      Llama-3.2-3B     28      3072    24 / 8      8192    yes
    8b      Llama-3.1-8B     32      4096    32 / 8      14336   no
    tiny    (tests)          2       128     4 / 2       256     yes
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np

WEIGHT_STD = 0.02
ROPE_THETA = 500000.0


class Shape(NamedTuple):
    like: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 16, 2048, 32, 8, 8192, True),
    "3b": Shape("Llama-3.2-3B", 28, 3072, 24, 8, 8192, True),
    "8b": Shape("Llama-3.1-8B", 32, 4096, 32, 8, 14336, False),
    "tiny": Shape("tests", 2, 128, 4, 2, 256, True),
}


def tensor_shapes(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in file order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        out += [(f"blk.{i}.attn_norm.weight", (shape.hidden,)),
                (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
                (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
                (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
                (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
                (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
                (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)),
                (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)),
                (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn))]
    out.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, shape.hidden)))
    return out


def num_params(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(dims)) for _, dims in tensor_shapes(shape, vocab))


def write_gguf(shape: Shape, path: Path, tokenizer_gguf: str, seed: int = 0) -> Path:
    """An F16 GGUF of `shape` at `path` (norm weights F32, all ones), tokenizer copied."""
    import gguf

    from duplex.engine.models.gguf_reader import read_gguf

    source = read_gguf(tokenizer_gguf)
    vocab = len(source.fields["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_model_keys(writer, shape, vocab)
    _copy_tokenizer(writer, source)
    names = tensor_shapes(shape, vocab)
    for name, dims in names:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in names:
        writer.write_tensor_data(_random_tensor(rng, dims))
    writer.close()
    return path


def _add_model_keys(writer, shape: Shape, vocab: int) -> None:
    writer.add_name(f"random {shape.like} shape")
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # MOSTLY_F16


def _copy_tokenizer(writer, source) -> None:
    """Every tokenizer.* key of the source file, with its own value types."""
    for key, value in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types = source.types[key]
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)


def _random_tensor(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    out = np.empty(dims, dtype=np.float16)
    for start in range(0, dims[0], 1024):  # a row block at a time: no float64 copy of it all
        block = rng.standard_normal((min(1024, dims[0] - start), dims[1]), dtype=np.float32)
        out[start:start + len(block)] = block * WEIGHT_STD
    return out


def quantize(f16_path: Path, out_path: Path, quant: str, bin_dir: Path, threads: int = 2) -> Path:
    """`llama-quantize F16 OUT QUANT`: the quantization mix llama.cpp gives that type."""
    tool = bin_dir / "llama-quantize"
    if not tool.is_file():
        raise FileNotFoundError(f"{tool} is missing: run `cmake --build build --target "
                                f"llama-quantize` in {bin_dir.parent.parent}")
    subprocess.run([str(tool), str(f16_path), str(out_path), quant, str(threads)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out_path


def shape_model(name: str, quant: str, out_dir: Path, tokenizer_gguf: str,
                bin_dir: Path | None) -> Path:
    """The `name` shape quantized to `quant` in out_dir, made once and reused (F16 for F16)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"random-{name}-F16.gguf"
    if not f16.is_file():
        write_gguf(SHAPES[name], f16.with_suffix(".part"), tokenizer_gguf).rename(f16)
    if quant.upper() == "F16":
        return f16
    target = out_dir / f"random-{name}-{quant}.gguf"
    if not target.is_file():
        if bin_dir is None:
            raise FileNotFoundError("quantizing needs llama.cpp's llama-quantize (--llama-dir)")
        quantize(f16, target.with_suffix(".part"), quant, bin_dir).rename(target)
    return target
