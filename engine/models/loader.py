"""Model loading: GGUF files (dequantized with `gguf`) and local Hugging Face directories.

Produces `ModelArgs` (the architecture's hyper-parameters, one frozen object) and a state
dict in Hugging Face parameter names, whatever the source format, so each model file under
engine/models/ loads one naming scheme only. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from duplex.engine.models.args import (  # noqa: F401 (FULL, SLIDING re-exported)
    FULL, SLIDING, ModelArgs, ModelLoadError, hf_config_to_args)
from duplex.engine.models import gguf_file
from duplex.engine.models.gguf_quant import INT4_TYPES, unpack_int4, unpack_q8_0
from duplex.kernels.quant import INT4_GROUP, QuantEmbedding, QuantWeight

class LoadedModel(NamedTuple):
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    identity: str  # digest of the weights: the root of every KV content address
    name: str


def load(path: str, dtype: torch.dtype = torch.float32, progress: bool = True,
         quant: str = "none") -> LoadedModel:
    """quant: "none" (every weight in `dtype`), "auto" (a GGUF file's 4/8-bit linear weights
    stay quantized, see `_gguf_linear`), "int4" or "int8" (every linear weight quantized).
    Quantized weights are `kernels.quant` objects in the state dict; the rest is `dtype`."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path, dtype, progress, quant)
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, progress, quant)
    raise ModelLoadError(f"not a .gguf file or a Hugging Face model directory: {path}")


QUANT_ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # dense models whose linears may quantize
QUANT_MODES = ("none", "auto", "int4", "int8")


def is_quantizable(name: str) -> bool:
    """A dense linear weight (attention / MLP projections, the output head)."""
    return name == "lm_head.weight" or (name.endswith("_proj.weight") and ".mlp.experts" not in name)


def quantize_float(w: torch.Tensor, quant: str, with_dense: bool = False) -> QuantWeight:
    """A float `[N, K]` weight in the requested scheme (int4 needs K divisible by 32)."""
    if quant == "int4" and w.shape[1] % INT4_GROUP == 0:
        return QuantWeight.int4_from_float(w, with_dense=with_dense)
    return QuantWeight.int8_from_float(w, with_dense=with_dense)


def weights_digest(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(files):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------- GGUF
def check(path: str) -> ModelArgs:
    """The model's ModelArgs, after the checks a load makes before reading any weight
    (format, architecture, tensor types and shapes): a file Duplex cannot run fails here,
    cheaply, with a ModelLoadError naming it and the reason."""
    if path.endswith(".gguf") and os.path.isfile(path):
        return _inspect_gguf(path).args
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        return _hf_dir_args(path)
    raise ModelLoadError(f"not a .gguf file or a Hugging Face model directory: {path}")


class _GGUFModel(NamedTuple):
    reader: Any  # gguf_reader.GGUFFile
    meta: dict[str, Any]
    args: ModelArgs
    names: dict[str, gguf_file.TensorName]  # GGUF tensor name -> where it goes


def _inspect_gguf(path: str) -> _GGUFModel:
    reader = gguf_file.open_reader(path)
    meta = _meta(reader)
    shapes = {t.name: _shape(t) for t in reader.tensors}
    rope_freqs = next((_dequantize(t, path) for t in reader.tensors
                       if t.name == gguf_file.ROPE_FREQS), None)
    try:
        args = hf_config_to_args(gguf_file.hf_config(path, meta, shapes, rope_freqs))
    except (KeyError, TypeError) as error:  # a metadata key missing or of the wrong kind
        raise ModelLoadError(f"{path}: incomplete GGUF metadata ({error!r})") from None
    names = {t.name: gguf_file.tensor_name(t.name, args.arch) for t in reader.tensors
             if t.name not in gguf_file.CONFIG_TENSORS}
    gguf_file.check_complete(set(names), args, path)
    _check_tensors(reader, names, args, path)
    return _GGUFModel(reader, meta, args, names)


def _load_gguf(path: str, dtype: torch.dtype, progress: bool, quant: str) -> LoadedModel:
    reader, meta, args, names = _inspect_gguf(path)
    quant = _check_quant(quant, args.arch)
    from duplex.engine.models.gguf_quant import vnni_layouts
    vnni = vnni_layouts(Path(path).stat().st_size)
    state = {}
    for t in tqdm(reader.tensors, desc="loading", unit="tensor", disable=None if progress else True):  # None: on a terminal only
        target = names.get(t.name)  # None: read into the config (CONFIG_TENSORS)
        if target is None:
            continue
        if target.expert_prefix is not None:
            state.update(_gguf_experts(t, target, dtype))
        else:
            state[target.hf_name] = _gguf_tensor(t, target.hf_name, args, dtype, quant, vnni)
    if quant != "none" and "lm_head.weight" not in state:  # tied: the head gets its own copy
        state["lm_head.weight"] = _tied_head(state["model.embed_tokens.weight"], quant)
    gguf_file.complete_mla(state, args)
    name = meta.get("general.name") or Path(path).stem
    return LoadedModel(args, state, weights_digest([Path(path)]), str(name))


def _shape(t) -> tuple[int, ...]:
    """A GGUF tensor's row-major shape (GGUF lists the fastest axis first)."""
    return tuple(reversed(t.shape))


def _check_tensors(reader, names: dict, args: ModelArgs, path: str) -> None:
    """Every tensor has a type Duplex can read and the shape the metadata implies."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import _type_traits

    readable = {Q.F32, Q.F16, *_type_traits}
    for t in reader.tensors:
        if t.tensor_type not in readable:
            raise ModelLoadError(f"{path}: tensor {t.name} has quantization type "
                                 f"{t.tensor_type.name}, which Duplex cannot read")
        if t.name in names and names[t.name].expert_prefix is None:
            gguf_file.check_shape(t.name, names[t.name].hf_name, _shape(t), args, path)


def _dequantize(t, path: str) -> np.ndarray:
    """A GGUF tensor's values as float32, in its row-major shape."""
    from gguf import dequantize

    try:
        values = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"{path}: tensor {t.name} has quantization type "
                             f"{t.tensor_type.name}, which Duplex cannot read") from None
    return np.asarray(values, dtype=np.float32).reshape(_shape(t))


def _gguf_experts(t, target, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A stacked expert tensor [experts, rows, cols] as one HF weight per expert."""
    from gguf import dequantize

    stacked = dequantize(t.data, t.tensor_type).reshape(_shape(t))
    tensor = torch.from_numpy(np.array(stacked, dtype=np.float32, copy=True)).to(dtype)
    return {f"{target.expert_prefix}.{e}.{target.expert_suffix}": w
            for e, w in enumerate(tensor.unbind(0))}


def _check_quant(quant: str, arch: str) -> str:
    if quant not in QUANT_MODES:
        raise ModelLoadError(f"unknown quantization {quant!r}; one of {', '.join(QUANT_MODES)}")
    if quant in ("int4", "int8") and arch not in QUANT_ARCHS:
        raise ModelLoadError(f"--dtype {quant} is supported for {', '.join(QUANT_ARCHS)}, "
                             f"not {arch}")
    return quant if arch in QUANT_ARCHS else "none"


def _gguf_tensor(t, name: str, args: ModelArgs, dtype: torch.dtype, quant: str, vnni: bool):
    """One GGUF tensor as the model will hold it: quantized or dequantized to `dtype`
    (`vnni`: Q4 weights get the VNNI layout too, gguf_quant.vnni_layouts)."""
    from gguf import dequantize

    from duplex.engine.models.gguf_quant import OWN_BITS_TYPES, gguf_weight, quantized_linear

    type_name = t.tensor_type.name
    shape = _shape(t)
    permute = gguf_file.rotary_rows(name, args)
    if quant != "none" and is_quantizable(name):  # auto: the file's own bits, no dense copy
        weight = quantized_linear(type_name, t.data, shape[-1], permute, quant, dtype, vnni)
        if weight is not None:
            return weight
    if name == "model.embed_tokens.weight":
        if quant == "auto" and type_name in OWN_BITS_TYPES:  # rows dequantized when looked up
            table = gguf_weight(type_name, t.data, shape[-1], lambda rows: rows, vnni)
            table.dtype = dtype
            return table
        if quant != "none" and type_name == "Q8_0":
            return QuantEmbedding(*unpack_q8_0(t.data, shape[-1]), dtype=dtype)
    array = permute(dequantize(t.data, t.tensor_type).reshape(shape))
    tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    tensor = tensor - gguf_file.norm_offset(name, args)
    if name.endswith("shared_expert_gate.weight"):
        tensor = tensor.reshape(1, -1)  # [1, hidden]; GGUF keeps it 1-D
    if quant in ("int4", "int8") and is_quantizable(name):
        return quantize_float(tensor, quant)
    return tensor.to(dtype)


def _tied_head(embed, quant: str) -> QuantWeight:
    """The output head of a tied-embedding model: a GGUF table's own blocks (the same
    object: one copy of the bytes), else quantized like the file's embedding."""
    if isinstance(embed, QuantWeight):
        return embed
    table = embed.dequantize() if isinstance(embed, QuantEmbedding) else embed.float()
    return quantize_float(table, "int8" if quant == "auto" else quant, quant == "auto")


def _meta(file) -> dict[str, Any]:
    """The metadata a model needs: every key but the vocabulary (tokenizer.ggml.* arrays; the
    token ids are kept) and arrays of strings."""
    from gguf import GGUFValueType

    return {k: (None if file.types[k][-1] == GGUFValueType.STRING and len(file.types[k]) > 1
                else v)
            for k, v in file.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}


# ---------------------------------------------------------------------------- HF directory
def _load_hf_dir(path: str, dtype: torch.dtype, progress: bool, quant: str) -> LoadedModel:
    from safetensors.torch import load_file

    args = _hf_dir_args(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    quant = _check_quant(quant, args.arch)
    quant = "none" if quant == "auto" else quant  # auto keeps the file's (float) precision
    state = {}
    for f in tqdm(files, desc="loading", unit="file", disable=None if progress else True):  # None: on a terminal only
        for name, tensor in load_file(str(f)).items():
            quantized = quant != "none" and is_quantizable(name)
            state[name] = quantize_float(tensor, quant) if quantized else tensor.to(dtype)
    if quant != "none" and "lm_head.weight" not in state:
        state["lm_head.weight"] = _tied_head(state["model.embed_tokens.weight"], quant)
    return LoadedModel(args, state, weights_digest(files), Path(path).name)


def _hf_dir_args(path: str) -> ModelArgs:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        return hf_config_to_args(json.loads(config_path.read_text()))
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, ModelLoadError):
            raise
        raise ModelLoadError(f"{config_path}: not a usable config ({error!r})") from None
