"""Llama-family decoder (Llama, SmolLM2, Mistral), built bottom-up.

The forward takes a flattened varlen batch: the new tokens of many requests concatenated,
prefill chunks and decode tokens alike. Attention reads and writes the paged KV cache
through `kernels.ops`; everything the step needs besides weights arrives in a
`ForwardContext`, so the model holds no per-step state. Weights are plain tensors loaded
from Hugging Face names; q/k/v and gate/up projections are fused into one matmul each.
Each layer attends over a sliding window or the whole context (`layer_windows`, from the
config's layer_types); the KV cache keeps every position either way.
Qwen2 and Qwen3 (engine/models/qwen.py) and Gemma 3 (engine/models/gemma3.py) build on this.
"""
from __future__ import annotations

import dataclasses

import torch

from duplex.engine.models.args import ModelArgs
from duplex.kernels import cpu_decode, cpu_fused, ops, quant, switches
from duplex.kernels.batch_invariant import is_batch_invariant
from duplex.kernels.gguf_weight import GGUFWeight
from duplex.kernels.quant import QuantWeight
from duplex.kernels.attention import AttentionPlan, plan_attention
from duplex.kernels.decode_attention import StepLens
from duplex.kernels.rotary import RopeTables, rope_cos_sin_cache, rope_tables


@dataclasses.dataclass
class ForwardContext:
    """Per-step inputs besides token ids (see kernels.attention for the conventions)."""
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    # hybrid KV (engine/hybrid_kv.py): sliding-window layers' own block ids; None: shared
    swa_block_tables: torch.Tensor | None = None  # int32 [num_seqs, max_blocks]
    swa_slot_mapping: torch.Tensor | None = None  # int64 [num_tokens]
    # the same numbers on the host (ModelRunner knows them): with them the step's attention
    # indices and masks are built once for all layers (kernels.attention.plan_attention)
    query_lens: list[int] | None = None
    host_seq_lens: list[int] | None = None
    block_size: int = 0
    slots_valid: bool | None = None  # no negative slot in slot_mapping (None: unknown)
    # bool [num_tokens]: the tokens a step's statistics count (a decode graph's padding rows
    # do not; engine/cuda_graphs.py); None: every token
    counted: torch.Tensor | None = None
    # set by the model for the step: the dtype its matmuls take and give (bf16 when every one
    # runs through a bf16 dense copy); None: the activations' dtype throughout
    gemm_dtype: torch.dtype | None = None
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def group_inputs(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, slot_mapping) of a layer's KV group."""
        if sliding_window is not None and self.swa_block_tables is not None:
            return self.swa_block_tables, self.swa_slot_mapping
        return self.block_tables, self.slot_mapping

    def attention_plan(self, sliding_window: int | None) -> AttentionPlan | None:
        """The step's attention plan for a layer with this window (one per KV group and
        window, built on first use); None on a device or without host numbers."""
        if self.query_lens is None or ops.runs_triton(self.positions):
            return None
        key = ("plan", sliding_window)
        if key not in self._memo:
            block_tables, _ = self.group_inputs(sliding_window)
            self._memo[key] = plan_attention(block_tables, self.query_lens, self.host_seq_lens,
                                             self.block_size, sliding_window)
        return self._memo[key]

    def step_lens(self) -> StepLens | None:
        """The step's host lengths for the GPU attention launches; None without them."""
        if self.query_lens is None or self.host_seq_lens is None:
            return None
        if "lens" not in self._memo:
            self._memo["lens"] = StepLens.of(self.query_lens, self.host_seq_lens)
        return self._memo["lens"]

    def rope(self, cos_sin: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The step's rotary tables from a cos/sin cache (built once, shared by layers)."""
        key = ("rope", id(cos_sin), dtype)
        if key not in self._memo:
            self._memo[key] = rope_tables(self.positions, cos_sin, dtype)
        return self._memo[key]


class Attention:
    # q and k rotate as one [T, heads + kv_heads, D] tensor: true unless a subclass changes
    # them between projection and rotary (per-head norms)
    joint_rope = True

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.sliding_window = args.layer_windows[layer]  # None: full attention
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        self.qkv_weight = ops.concat_weights([state.pop(f"{n}.weight") for n in names])
        self.qkv_bias = (torch.cat([state.pop(f"{n}.bias") for n in names])
                         if args.attention_bias else None)
        self.o_weight = state.pop(f"{prefix}.o_proj.weight")

    def project_qkv(self, x: torch.Tensor):
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]
        return (q.reshape(-1, self.num_heads, self.head_dim),
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def rotated_qkv(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: torch.Tensor):
        """q, k after rotary, and v. On the CPU with a full-dim neox cache q and k rotate
        together, in place, with one fused kernel (or from the step's shared tables);
        otherwise through ops.rotary_embedding."""
        fast = ctx.query_lens is not None and not ops.runs_triton(x) and \
            cos_sin.shape[-1] == self.head_dim
        if not (fast and self.joint_rope):
            q, k, v = self.project_qkv(x)
            if not fast:
                return (*ops.rotary_embedding(ctx.positions, q, k, cos_sin), v)
            return (*(self._rotate(t, ctx, cos_sin) for t in (q, k)), v)
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)  # [T, q_size + 2 * kv_size]
        num_tokens = qkv.shape[0]
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = self._rotate(qk, ctx, cos_sin)  # [T, heads + kv_heads, D]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, -1, self.head_dim)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v

    @staticmethod
    def _rotate(x: torch.Tensor, ctx: ForwardContext, cos_sin: torch.Tensor) -> torch.Tensor:
        if ops.rope_inplace(x, ctx.positions, cos_sin):
            return x
        return ops.apply_rope(x, ctx.rope(cos_sin, x.dtype))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int,
                cos_sin: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = ctx.kv_caches[layer]
        block_tables, slot_mapping = ctx.group_inputs(self.sliding_window)
        valid = ctx.slots_valid if slot_mapping is ctx.slot_mapping else None
        if ctx.gemm_dtype is not None:  # the bf16 stream: x and the q/k/v output are bf16
            qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)
            q = ops.rope_and_store_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                      ctx.positions, cos_sin, k_cache, v_cache, slot_mapping,
                                      valid)
        else:
            q, k, v = self.rotated_qkv(x, ctx, cos_sin)
            ops.store_kv(k, v, k_cache, v_cache, slot_mapping, valid)
        out = ops.paged_attention(q, k_cache, v_cache, block_tables, ctx.query_start_loc,
                                  ctx.seq_lens, self.scale, self.sliding_window,
                                  plan=ctx.attention_plan(self.sliding_window),
                                  lens=ctx.step_lens())
        return ops.linear(out.reshape(-1, self.q_size), self.o_weight,  # [T, hidden]
                          out_dtype=ctx.gemm_dtype)


class MLP:
    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        gate, up = state.pop(f"{prefix}.gate_proj.weight"), state.pop(f"{prefix}.up_proj.weight")
        self.intermediate = gate.shape[0]
        self.gate_up_weight = ops.concat_weights([gate, up])
        self.down_weight = state.pop(f"{prefix}.down_proj.weight")

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`[T, 2 * intermediate]` -> `act(gate) * up`."""
        return ops.silu_and_mul(gate_up)

    def forward(self, x: torch.Tensor, stream: torch.dtype | None = None) -> torch.Tensor:
        """`stream` (ForwardContext.gemm_dtype): x and the output are in that dtype, and so is
        the activation between the two matmuls."""
        gate_up = ops.linear(x, self.gate_up_weight)
        act = self.act_and_mul(gate_up) if stream is None else \
            ops.silu_and_mul(gate_up, out_dtype=stream)
        return ops.linear(act, self.down_weight)


class DecoderLayer:
    attention_cls = Attention

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        self.eps = args.rms_norm_eps
        self.input_norm = state.pop(f"{prefix}.input_layernorm.weight")
        self.post_norm = state.pop(f"{prefix}.post_attention_layernorm.weight")
        self.attn = self.attention_cls(args, state, f"{prefix}.self_attn", layer)
        self.mlp = MLP(state, f"{prefix}.mlp")

    def forward(self, h, residual, ctx: ForwardContext, layer: int, cos_sin):
        stream = ctx.gemm_dtype  # None, or the bf16 stream (then h arrives and leaves in bf16)
        if residual is None:
            h, residual = ops.rms_norm(h, self.input_norm, self.eps, out_dtype=stream), h
        else:
            h, residual = ops.rms_norm(h, self.input_norm, self.eps, residual, out_dtype=stream)
        h = self.attn.forward(h, ctx, layer, cos_sin)
        h, residual = ops.rms_norm(h, self.post_norm, self.eps, residual, out_dtype=stream)
        return (self.mlp.forward(h) if stream is None else self.mlp.forward(h, stream)), residual


class LlamaForCausalLM:
    layer_cls = DecoderLayer

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)  # weights are popped as layers take them
        self.args = args
        self.embed = state.pop("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = [self.layer_cls(args, state, f"model.layers.{i}", i)
                       for i in range(args.num_layers)]
        self.layer_windows: list[int | None] = args.layer_windows  # None: full attention
        self.norm = state.pop("model.norm.weight")
        lm_head = state.pop("lm_head.weight", None)
        tied = (args.tie_word_embeddings or lm_head is None) and not isinstance(lm_head, QuantWeight)
        self.lm_head = self.embed if tied else lm_head  # a quantized head is its own copy
        if isinstance(self.lm_head, GGUFWeight):
            self.lm_head.fp32_out = True  # logits are never rounded to bf16
        self.cos_sin = self.rope_cache(args)
        self._decode_stack: cpu_decode.DecodeStack | None | bool = None  # None: not built yet
        self._stream_rows: int | None | bool = None  # None: not looked at yet; False: never
        unused = [k for k in state if "rotary_emb" not in k]
        if unused:
            raise ValueError(f"weights not used by {args.arch}: {unused[:5]}")

    @staticmethod
    def rope_cache(args: ModelArgs) -> torch.Tensor:
        """The cos/sin cache. Scaled rope (linear, llama3, yarn: engine/models/args.py
        `dense_rope_scaling`; a GGUF file's rope_freqs tensor) comes as per-pair divisors
        of the default frequencies (`freq_factors`) and, for yarn, a cos/sin scale."""
        scaling = args.rope_scaling or {}
        factors = scaling.get("freq_factors")
        if factors is None:
            return rope_cos_sin_cache(args.head_dim, args.max_position_embeddings,
                                      args.rope_theta)
        dim, host = args.head_dim, torch.device("cpu")  # load time: placed with the weights
        pairs = torch.arange(0, dim, 2, dtype=torch.int64, device=host).float()
        inv_freq = 1.0 / (args.rope_theta ** (pairs / dim))
        divisors = torch.tensor(factors, dtype=torch.float32, device=host)
        cache = rope_cos_sin_cache(dim, args.max_position_embeddings, inv_freq=inv_freq / divisors)
        scale = scaling.get("attention_factor", 1.0)
        return cache * scale if scale != 1.0 else cache

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]."""
        h = ops.embedding(input_ids, self.embed)
        stack = self._fused_decode(h, ctx)
        if stack is not None:
            return stack.forward(h, ctx.kv_caches, ctx.positions, ctx.slot_mapping,
                                 ctx.block_tables, ctx.seq_lens, ctx.block_size)
        ctx.gemm_dtype = self._gemm_stream(h)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer.forward(h, residual, ctx, i, self.cos_sin)
        h, _ = ops.rms_norm(h, self.norm, self.args.rms_norm_eps, residual,
                            out_dtype=None if ctx.gemm_dtype is None else residual.dtype)
        return h

    def _gemm_stream(self, h: torch.Tensor) -> torch.dtype | None:
        """bf16 when every matmul of this step runs through its weight's bf16 dense copy
        (enough rows, or a prompt step) on the CPU with the fused kernels on: the layers then
        pass the matmuls' bf16 outputs straight to the fused norm, rotary + cache write and
        SiLU kernels and take bf16 back, instead of converting each to fp32 and back (8
        conversion ops a layer fewer). The roundings are the same ones, so the step's results
        are bitwise those of the fp32 activations path (`DUPLEX_BF16_STREAM=0`)."""
        if self._stream_rows is None:
            self._stream_rows = stream_rows(self) or False
        if not self._stream_rows or h.dtype != torch.float32 or ops.runs_triton(h) \
                or not cpu_fused.is_enabled() or is_batch_invariant() \
                or switches.is_off("DUPLEX_BF16_STREAM"):
            return None
        return torch.bfloat16 if quant.in_prompt_step() or h.shape[0] >= self._stream_rows \
            else None

    def _fused_decode(self, h: torch.Tensor, ctx: ForwardContext) -> cpu_decode.DecodeStack | None:
        """The one-call decode stack (kernels.cpu_decode) when this step can take it: every
        row decodes, few enough rows for every weight's few-row kernel (the stack's
        max_rows), the fused CPU kernels on."""
        if self._decode_stack is False or ctx.query_lens is None or ops.runs_triton(h) \
                or len(ctx.query_lens) != h.shape[0] \
                or ctx.slots_valid is not True or ctx.swa_block_tables is not None \
                or not cpu_fused.is_enabled() or is_batch_invariant() or quant.in_prompt_step():
            return None
        if not (cpu_decode.available() and cpu_decode.step_fits(
                h, ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens,
                ctx.kv_caches)):
            return None
        if self._decode_stack is None:
            self._decode_stack = decode_stack(self) or False
        stack = self._decode_stack or None
        return stack if stack is not None and h.shape[0] <= stack.max_rows else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return ops.linear(hidden, self.lm_head).float()


def stream_rows(model: LlamaForCausalLM) -> int | None:
    """The fewest rows from which every matmul of the model runs through a bf16 dense copy,
    or None when a layer is not the plain Llama one or a weight has no dense copy."""
    rows = 0
    for layer in model.layers:
        a, mlp = layer.attn, layer.mlp
        if (type(layer), type(a), type(mlp)) != (DecoderLayer, Attention, MLP) \
                or a.qkv_bias is not None:
            return None
        for w in (a.qkv_weight, a.o_weight, mlp.gate_up_weight, mlp.down_weight):
            need = w.dense_from_rows() if isinstance(w, QuantWeight) else None
            if need is None:
                return None
            rows = max(rows, need)
    return rows


def decode_stack(model: LlamaForCausalLM) -> cpu_decode.DecodeStack | None:
    """The model's weights for kernels.cpu_decode, or None when a layer is not the plain
    Llama one (per-head norms, MoE, biases, windows) or a weight has no few-row kernel the
    C step runs (the VNNI layout, or a GGUF file's own rows)."""
    args, layers, max_rows = model.args, [], 1 << 30
    if args.head_dim % 16 or args.num_heads // args.num_kv_heads > 16 \
            or model.cos_sin.shape[-1] != args.head_dim:
        return None
    for layer in model.layers:
        a, mlp = layer.attn, layer.mlp
        if (type(layer), type(a), type(mlp)) != (DecoderLayer, Attention, MLP) \
                or a.qkv_bias is not None or a.sliding_window is not None:
            return None
        projections = [decode_parts(w) for w in
                       (a.qkv_weight, a.o_weight, mlp.gate_up_weight, mlp.down_weight)]
        if any(p is None for p in projections) or not _fp32(layer.input_norm, layer.post_norm):
            return None
        max_rows = min([max_rows, *(rows for _, rows in projections)])
        layers.append(cpu_decode.LayerWeights(layer.input_norm, layer.post_norm,
                                              *(parts for parts, _ in projections)))
    if not _fp32(model.norm, model.cos_sin):
        return None
    dims = cpu_decode.Dims(args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                           sum(p.n for p in layers[0].gate_up) // 2, args.rms_norm_eps)
    return cpu_decode.DecodeStack(layers, dims, model.norm, model.cos_sin, max_rows)


def decode_parts(w) -> tuple[tuple[cpu_decode.Part, ...], int] | None:
    """A projection's parts as the C step runs them, and the most rows for which the per-op
    path runs each through that same kernel (so the two agree bitwise), or None."""
    from duplex.kernels import cpu_gguf
    from duplex.kernels.gguf_weight import GGUFWeight

    parts = w.parts if isinstance(w, quant.FusedWeight) else [w]
    if not 1 <= len(parts) <= cpu_decode.MAX_PARTS:
        return None
    out, rows = [], 1 << 30
    for p in parts:
        packed = p.vnni_layout() if isinstance(p, QuantWeight) else None
        if packed is not None:
            out.append(packed)
            rows = min(rows, quant.MAX_VNNI_ROWS)
        elif isinstance(p, GGUFWeight) and cpu_gguf.available():
            out.append(cpu_decode.GGUFRows(p.type_id, p.raw, p.shape[1]))
            rows = min(rows, p.row_limit())
        else:
            return None
    return tuple(out), rows


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
