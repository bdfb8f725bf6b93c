"""Mixture-of-experts building blocks shared by Mixtral, Qwen2/3-MoE and DeepSeek-V3.

Owns the routed-expert computation of one process (`LocalExperts`: every expert of every MoE
layer, plus the routed-token statistics) and the pieces a MoE decoder is made of: routers,
the `MoEBlock` that replaces a dense MLP, `MoEForCausalLM` with the switch between expert
backends. engine/expert_parallel.py provides the other backend (experts sharded over ranks).

The MoE families' hyper-parameters (`MoEArgs`, `MLAArgs`) live in engine/models/args.py.

An expert backend computes, for one MoE layer, `sum_j weight[t, j] * expert[ids[t, j]](x[t])`:

    forward(moe_layer, x [T, hidden], topk_ids [T, k], topk_weights [T, k]) -> [T, hidden]
    end_step()        once per step, after its forward and sampling (closes the statistics
                      step; the core calls it through the model's end_step)
    load_report()     ExpertLoadReport over the statistics window

Expert outputs are combined per token in top-k order with elementwise ops only, so a token's
result does not depend on which rank or replica computed each of its experts' rows.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from duplex.engine.eplb import ExpertLoadStats
from duplex.engine.models.llama import DecoderLayer, LlamaForCausalLM, MLP
from duplex.engine.models.args import MLAArgs, MoEArgs, ModelArgs  # noqa: F401 (re-exported)
from duplex.engine.stats import MoEStats
from duplex.kernels import batch_invariant as bi
from duplex.kernels import ops

# Steps of routed-token counts kept (a ring of window x layers x experts int64: 512 steps of
# DeepSeek-V3's 58 x 256 is 61 MB).
DEFAULT_STATS_WINDOW = 512


# ---------------------------------------------------------------------------- expert compute
class ExpertWeights(NamedTuple):
    """The routed experts of one layer (or the slots of one rank), stacked."""
    w13: torch.Tensor  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor  # [num_experts, hidden, intermediate]


def load_experts(state: dict[str, torch.Tensor], prefix: str, num_experts: int,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> ExpertWeights:
    """Pop `{prefix}.{e}.{gate,up,down}.weight` for every expert and stack them."""
    gate, up, down = ([state.pop(f"{prefix}.{e}.{name}.weight") for e in range(num_experts)]
                      for name in names)
    return ExpertWeights(torch.stack([torch.cat(pair) for pair in zip(gate, up)]),
                         torch.stack(down))


def run_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """x [N, hidden], expert_ids [N] (index into `weights`) -> [N, hidden]: each row through
    its expert's SwiGLU MLP. Rows are grouped by expert so each expert is one GEMM pair. An
    id equal to the number of experts marks a row with no expert: its output is 0.

    CUDA (or the triton interpreter): the grouped-GEMM triton kernels (kernels.fused_moe).
    CPU: a loop over the experts
    that have rows, through ops.linear (batch-invariant mode included). One padded bmm over
    all experts was measured against it (8 experts, hidden 1024, inter 512, 2 cores): 2.6 ms
    vs 0.7 ms at 1 token, even at 16, 17 vs 24 ms at 128 tokens but then not bitwise equal
    to the per-expert GEMMs; the loop stays."""
    if ops.runs_triton(x):
        return ops.fused_moe(x, expert_ids[:, None], None, weights.w13, weights.w2)
    num_experts = weights.w13.shape[0]
    order = torch.argsort(expert_ids, stable=True)  # rows with no expert sort last
    counts = torch.bincount(expert_ids, minlength=num_experts + 1).tolist()
    xs = x[order]  # rows grouped by expert
    ys = torch.empty_like(xs)
    inter = weights.w2.shape[2]
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            rows = slice(start, start + count)
            gate, up = ops.linear(xs[rows], weights.w13[expert]).split(inter, dim=-1)
            ys[rows] = ops.linear(ops.silu(gate) * up, weights.w2[expert])
            start += count
    ys[start:] = 0
    out = torch.empty_like(ys)
    out[order] = ys
    return out


def combine(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """expert_out [T, k, hidden] (unweighted), topk_weights [T, k] -> [T, hidden].
    A fixed left-to-right sum of elementwise products: exact ops only, so the result for a
    token depends on nothing but its own rows."""
    weights = topk_weights.to(expert_out.dtype)
    out = expert_out[:, 0] * weights[:, :1]
    for j in range(1, expert_out.shape[1]):
        out = out + expert_out[:, j] * weights[:, j:j + 1]
    return out


class ExpertLoadReport(NamedTuple):
    """Routed tokens over the statistics window, for /metrics and the balancer."""
    expert_load: np.ndarray  # [num_moe_layers, num_experts]
    rank_load: np.ndarray  # [num_moe_layers, num_ranks]: tokens each rank computed
    imbalance: np.ndarray  # [num_moe_layers]: max / mean of rank_load (1.0 = balanced)

    def stats(self) -> MoEStats:
        """For WorkerStats / Prometheus."""
        return MoEStats(rank_tokens=[float(t) for t in self.rank_load.sum(axis=0)],
                        imbalance_mean=float(self.imbalance.mean()),
                        imbalance_max=float(self.imbalance.max()))


def max_over_mean(rank_load: np.ndarray) -> np.ndarray:
    """[..., num_ranks] -> [...]: max / mean, 1.0 where nothing was routed."""
    mean = rank_load.mean(axis=-1)
    return np.where(mean > 0, rank_load.max(axis=-1) / np.where(mean > 0, mean, 1), 1.0)


class StepCounts:
    """Counters of one step, per layer, kept on the device: `add` counts in place (a
    captured CUDA graph replays it; nothing is read back), `take` brings the step's counts
    to the host in one copy and starts the next step. The core takes them after the
    sampler has read the step's tokens, so the copy waits for nothing."""

    def __init__(self, num_layers: int, num_bins: int) -> None:
        self.shape = (num_layers, num_bins)
        self._counts: torch.Tensor | None = None  # made on the first add's device

    def add(self, layer: int, values: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """Count each of `values` (ints in [0, num_bins), [T] or [T, k]) for `layer`; with
        `counted` (bool [T]) only the rows it marks."""
        with torch.inference_mode():  # steps run under it; a unit test may not
            if self._counts is None or self._counts.device != values.device:
                self._counts = torch.zeros(self.shape, dtype=torch.long, device=values.device)
            ones = torch.ones_like(values, dtype=torch.long)
            if counted is not None:
                ones = ones * counted.view(-1, *([1] * (values.dim() - 1)))
            self._counts[layer].scatter_add_(0, values.reshape(-1).long(), ones.reshape(-1))

    def take(self) -> np.ndarray:
        """[num_layers, num_bins] int64 counted since the last take."""
        if self._counts is None:
            return np.zeros(self.shape, dtype=np.int64)
        counts = self._counts.cpu().numpy().copy()  # a copy: on the CPU, .cpu() is the same
        with torch.inference_mode():
            self._counts.zero_()
        return counts


class LocalExperts:
    """Expert backend of a single process: every expert of every MoE layer is here."""

    def __init__(self, weights: list[ExpertWeights], window_steps: int = DEFAULT_STATS_WINDOW):
        self.weights = weights  # [num_moe_layers]
        self.num_experts = weights[0].w13.shape[0]
        self.stats = ExpertLoadStats(len(weights), self.num_experts, window_steps)
        self.step_counts = StepCounts(len(weights), self.num_experts)
        self.counted: torch.Tensor | None = None  # the step's counted rows (ForwardContext)

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        self.step_counts.add(moe_layer, topk_ids, self.counted)
        if ops.runs_triton(x):  # routing weights and the top-k sum inside the fused kernels
            weights = self.weights[moe_layer]
            return ops.fused_moe(x, topk_ids, topk_weights, weights.w13, weights.w2)
        k = topk_ids.shape[1]
        out = run_experts(x.repeat_interleave(k, dim=0), topk_ids.reshape(-1),
                          self.weights[moe_layer])  # [T * k, hidden], (token, j) order
        return combine(out.view(x.shape[0], k, -1), topk_weights)

    def end_step(self) -> None:
        for moe_layer, counts in enumerate(self.step_counts.take()):
            self.stats.record(moe_layer, counts)
        self.stats.step()

    def load_report(self) -> ExpertLoadReport:
        load = self.stats.load()
        rank_load = load.sum(axis=1, keepdims=True)
        return ExpertLoadReport(load, rank_load, max_over_mean(rank_load))


def count_pairs(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] int64 on ids' device: how many of `ids` (any shape, values < num_bins) are
    each value. A scatter-add, not torch.bincount, which on CUDA reads the ids' max back."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_bins, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


# ---------------------------------------------------------------------------- routers
def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim, batch invariant when that mode is on."""
    return bi.bi_softmax(x) if bi.is_batch_invariant() else torch.softmax(x.float(), dim=-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid; from exp in batch-invariant mode (torch's differs between vector lanes)."""
    x = x.float()
    return 1.0 / (1.0 + torch.exp(-x)) if bi.is_batch_invariant() else torch.sigmoid(x)


def softmax_topk(logits: torch.Tensor, moe: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen router: logits [T, E] -> (fp32 weights [T, k], ids [T, k])."""
    weights, ids = torch.topk(softmax(logits), moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEArgs
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek router: logits [T, E] -> (fp32 weights [T, k], ids [T, k]).

    V3 (scoring "sigmoid"): experts are chosen on sigmoid scores plus the load-balancing
    `bias` (e_score_correction_bias), only from the `topk_groups` groups whose two best biased
    scores sum highest. V2 / V2.5 ("softmax"): on softmax scores (plus `bias` if a file has
    one), from the groups whose best score is highest. The weights are the unbiased scores,
    optionally renormalised, times routed_scaling_factor."""
    softmax = moe.scoring == "softmax"
    scores = logits.float().softmax(dim=-1) if softmax else sigmoid(logits)  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    num_tokens = logits.shape[0]
    grouped = choice.view(num_tokens, moe.num_groups, -1)  # [T, groups, experts per group]
    if softmax:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, moe.topk_groups, dim=-1)[1]  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape_as(choice),
                                float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


# ---------------------------------------------------------------------------- decoder pieces
class MoEBlock:
    """The MLP of a MoE layer: router, routed experts (through the model's expert backend),
    and an optional shared expert added to every token."""
    shared_name = "shared_expert"  # HF module name of the shared expert, if there is one

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 moe_layer: int) -> None:
        self.moe = args.moe
        self.moe_layer = moe_layer  # index among the MoE layers (the backend's layer id)
        self.gate_weight = state.pop(f"{prefix}.gate.weight")  # [num_experts, hidden]
        self.shared = MLP(state, f"{prefix}.{self.shared_name}") \
            if self.moe.shared_intermediate_size else None
        self.shared_gate = state.pop(f"{prefix}.shared_expert_gate.weight") \
            if self.moe.shared_expert_gate else None  # [1, hidden]
        self.experts = None  # the expert backend, set by MoEForCausalLM.set_expert_backend

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, num_experts] -> (fp32 weights [T, k], expert ids [T, k])."""
        return softmax_topk(logits, self.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(x, self.gate_weight)  # [T, num_experts]
        weights, ids = self.route(logits)
        out = self.experts.forward(self.moe_layer, x, ids, weights)
        if self.shared is not None:
            shared = self.shared.forward(x)
            if self.shared_gate is not None:
                shared = sigmoid(ops.linear(x, self.shared_gate)).to(x.dtype) * shared
            out = out + shared
        return out


class MoEDecoderLayer(DecoderLayer):
    """A Llama-shaped decoder layer whose MLP is a MoEBlock (or dense, per args.moe)."""
    block_cls = MoEBlock
    block_name = "mlp"  # HF module name of the MLP

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        # Not DecoderLayer.__init__: that one would load a dense MLP for every layer.
        self.eps = args.rms_norm_eps
        self.input_norm = state.pop(f"{prefix}.input_layernorm.weight")
        self.post_norm = state.pop(f"{prefix}.post_attention_layernorm.weight")
        self.attn = self.attention_cls(args, state, f"{prefix}.self_attn", layer)
        if layer in args.moe.moe_layers:
            self.mlp = self.block_cls(args, state, f"{prefix}.{self.block_name}",
                                      args.moe.moe_layers.index(layer))
        else:
            self.mlp = MLP(state, f"{prefix}.mlp")


class MoEForCausalLM(LlamaForCausalLM):
    """A decoder with MoE layers. Routed experts live in one expert backend shared by every
    MoE block: `LocalExperts` after loading, swapped by `set_expert_backend` (expert
    parallelism). Subclasses set `layer_cls` and `expert_prefix` / `expert_names`."""
    layer_cls = MoEDecoderLayer
    expert_prefix = "mlp.experts"
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        experts = [load_experts(state, f"model.layers.{i}.{self.expert_prefix}",
                                args.moe.num_experts, self.expert_names)
                   for i in args.moe.moe_layers]
        super().__init__(args, state)
        self.set_expert_backend(LocalExperts(experts))

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def set_expert_backend(self, backend) -> None:
        """Route every MoE block's experts through `backend` from the next forward on."""
        self.expert_backend = backend
        for block in self.moe_blocks:
            block.experts = backend

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        self.expert_backend.counted = ctx.counted  # a decode graph's padding rows: not load
        return super().forward(input_ids, ctx)

    def end_step(self) -> None:
        """Close the step's expert statistics (and, under expert parallelism, maybe switch
        placements): the core calls it once after each step's forward and sampling."""
        self.expert_backend.end_step()

    def expert_load(self) -> ExpertLoadReport:
        """Routed tokens per layer, expert and rank over the statistics window."""
        return self.expert_backend.load_report()
