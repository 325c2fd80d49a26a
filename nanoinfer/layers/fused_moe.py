"""Mixture-of-experts SwiGLU MLPs: top-k softmax routing (or DeepSeek's group-limited and sigmoid routings, Llama 4's
sigmoid of the top k, PhiMoE's sparsemixer), then every expert at once as two grouped matmuls over the token-expert
pairs sorted by expert (FusedMoE; SparseMoeBlock puts the router in front), optionally with biases and GPT-OSS's
clamped SwiGLU, or without a gate (NemotronH's relu^2), the routing weights scaling the experts' outputs or (Llama 4)
their inputs, optionally skipping slots routed past the experts (LongCat-Flash's zero experts). Each rank holds a
slice of every expert's intermediate dimension. ExpertGroups, the sorting, serves JetMoE's attention experts too."""
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ReplicatedLinear, copy_weight
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size

# HF checkpoints store each expert separately: `<moe>.experts.<e>.{gate,up,down}_proj.weight`, or, in Mixtral's
# naming, `<moe>.experts.<e>.{w1,w3,w2}.weight`.
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_WEIGHT = re.compile(rf"\.experts\.(\d+)\.({'|'.join(_EXPERT_PROJ)})\.weight$")
# transformers' own layout (what `save_pretrained(save_original_format=False)` writes, and loads back): every
# expert in one tensor, `<moe>.experts.gate_up_proj` [experts, 2 * inter, hidden] (gate rows, then up rows; experts
# without a gate: `<moe>.experts.up_proj` [experts, inter, hidden]) and `<moe>.experts.down_proj` [experts, hidden,
# inter]; with biases (GPT-OSS), `<moe>.experts.gate_up_proj_bias` [experts, 2 * inter] and
# `<moe>.experts.down_proj_bias` [experts, hidden].
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up|up|down)_proj(_bias)?$")
# DBRX's layout: `<moe>.experts.mlp.{w1,v1,w2}`, every expert's gate / up / down (transposed) rows stacked in one
# [experts * inter, hidden] tensor each.
_DBRX_EXPERTS = re.compile(r"\.experts\.mlp\.(w1|v1|w2)$")
_DBRX_PROJ = {"w1": "gate", "v1": "up", "w2": "down"}


def expert_weight_target(name: str) -> tuple[str, tuple[int | None, str] | None] | None:
    """The FusedMoE parameter a checkpoint tensor belongs to and its (expert, "gate"|"up"|"down") shard id (None:
    all experts' stacked in transformers' layout; expert None: all experts' in DBRX's)."""
    kind = "weight"
    if m := _EXPERT_WEIGHT.search(name):
        proj = _EXPERT_PROJ[m.group(2)]
        shard = (int(m.group(1)), proj)
    elif m := _DBRX_EXPERTS.search(name):
        proj = _DBRX_PROJ[m.group(1)]
        shard = (None, proj)
    elif m := _STACKED_EXPERTS.search(name):
        proj, shard = m.group(1), None
        kind = "bias" if m.group(2) else kind
    else:
        return None
    return f"{name[:m.start()]}.experts.{'w2' if proj == 'down' else 'w13'}_{kind}", shard


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over all experts, keep the top k (optionally rescaled to sum to 1), as transformers does; the
    weights rounded to the logits' dtype, or (fp32_weights: Mixtral's router) left in fp32."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights if fp32_weights else weights.to(router_logits.dtype), ids


def select_experts_pnorm(router_logits: torch.Tensor, top_k: int, p: float | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DBRX: softmax over all experts in the logits' dtype, the top k divided by their p-norm
    (`moe_normalize_expert_weights`; None: left as they are), as transformers' DbrxFFN routes them."""
    weights, ids = torch.topk(torch.softmax(router_logits, dim=-1), top_k, dim=-1)
    if p is not None:
        weights = weights / torch.norm(weights, p=p, dim=-1, keepdim=True)
    return weights, ids


def select_experts_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS and GraniteMoE: the top k router logits softmaxed among themselves in fp32, rounded to the logits'
    dtype, as transformers routes them (the full softmax's top k renormalized is the same in exact arithmetic, not
    in bf16)."""
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(logits.float(), dim=-1).to(router_logits.dtype), ids


def mask_to_top_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
                       ) -> torch.Tensor:
    """scores [tokens, experts] with every expert outside each token's `topk_group` best groups (group_scores
    [tokens, groups]; the experts split into equal consecutive groups) set to `fill`, as DeepSeek's routers do."""
    chosen = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], 1.0)
    num_groups = group_scores.shape[1]
    keep = chosen.bool().repeat_interleave(scores.shape[1] // num_groups, dim=1)
    return scores.masked_fill(~keep, fill)


def select_experts_softmax_grouped(router_logits: torch.Tensor, top_k: int, num_groups: int | None,
                                   topk_group: int | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: fp32 softmax over all experts, restricted (num_groups not None: "group_limited_greedy") to the
    topk_group groups of the highest single expert score, top k kept unnormalized, times `scaling`."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if num_groups is not None:
        group_scores = scores.view(scores.shape[0], num_groups, -1).amax(dim=-1)
        scores = mask_to_top_groups(scores, group_scores, topk_group, 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)  # unsorted: see select_experts_sigmoid_biased
    return weights * scaling, ids


def select_experts_sigmoid_biased(router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None,
                                  num_groups: int, topk_group: int, renormalize: bool, scaling: float,
                                  sorted_topk: bool = False,
                                  scoring: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ("noaux_tc"): fp32 sigmoid scores (or `scoring`'s: DeepSeek-V4's sqrt(softplus)); the choice, among
    the topk_group groups whose two best biased scores sum highest, is the top k of score + correction_bias (None: of
    the scores); the weights are the unbiased scores (optionally rescaled to sum to 1, transformers' 1e-20 added to the
    sum), times `scaling`. The top k in torch.topk's unsorted order, as transformers' V3-style routers take them (the
    experts' fp32 sum follows that order, which for k > 2 rounds some rows otherwise), or sorted (sorted_topk: AFMoE's,
    Laguna's, Flint's)."""
    scores = scoring(router_logits.float())
    biased = scores if correction_bias is None else scores + correction_bias.float()
    group_scores = biased.view(scores.shape[0], num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    ids = torch.topk(mask_to_top_groups(biased, group_scores, topk_group, float("-inf")), top_k, dim=-1,
                     sorted=sorted_topk)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling, ids


def select_experts_biased_logits(router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor,
                                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Kolibri-1: the top k of the fp32 router logits plus correction_bias; the weights the sigmoid of the chosen
    (unbiased) logits, optionally rescaled to sum to 1, as transformers' Kolibri1TopKRouter computes them."""
    logits = router_logits.float()
    ids = torch.topk(logits + correction_bias.float(), top_k, dim=-1)[1]
    weights = logits.gather(1, ids).sigmoid()
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_sigmoid_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4: the top k router logits, each through a sigmoid in fp32 (no softmax, no rescaling), as transformers'
    Llama4Router computes them."""
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(logits.float()).to(router_logits.dtype), ids


def select_experts_sparsemixer(router_logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's sparsemixer at inference: two experts, the best and the second best; each weighs by a softmax over
    the experts whose logit lies within a relative 2 * jitter_eps of its own (the first choice left out of the
    second's), in the logits' dtype, as transformers computes it."""
    first = router_logits.argmax(dim=-1, keepdim=True)
    second_logits = router_logits.scatter(-1, first, float("-inf"))
    second = second_logits.argmax(dim=-1, keepdim=True)
    weights = [_sparsemixer_weight(router_logits, logits, chosen, jitter_eps)
               for logits, chosen in ((router_logits, first), (second_logits, second))]
    return torch.cat(weights, dim=-1), torch.cat((first, second), dim=-1)


def _sparsemixer_weight(scores: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, jitter_eps: float
                        ) -> torch.Tensor:
    """The softmax weight of the chosen expert (the top of `logits`) over those of `logits` near it."""
    top = logits.gather(-1, chosen)
    far = (top - scores) / scores.abs().clamp(min=top) > 2 * jitter_eps
    return torch.softmax(logits.masked_fill(far, float("-inf")), dim=-1).gather(-1, chosen)


# (gate, up) -> the activation that the down projection takes; of non-gated experts: (up) -> it.
GatedActivation = Callable[..., torch.Tensor]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def relu2(up: torch.Tensor) -> torch.Tensor:
    """NemotronH's non-gated expert activation, relu(x)^2."""
    return F.relu(up).square()


def clamped_swiglu(alpha: float, limit: float) -> GatedActivation:
    """GPT-OSS's expert activation, in the order of transformers' GptOssExperts._apply_gate: the gate clamped from
    above and the up projection on both sides to `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    return activation


def clamped_silu_and_mul(limit: float) -> GatedActivation:
    """HY-V4's expert activation (transformers' HYV4Experts._apply_gate): silu_and_mul with the gate clamped from
    above and the up projection on both sides to `limit`."""
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return activation


def softcapped_swiglu(gate_cap: float, up_cap: float) -> GatedActivation:
    """Inkling-2's expert activation, in fp32 as transformers' Inkling2SoftcappedSwiGLU: the sigmoid sees the raw gate,
    the softcaps (cap * tanh(x / cap)) bound the gate's linear factor and the up projection."""
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = gate.float(), up.float()
        return (torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
                ).to(gate.dtype)
    return activation


def experts_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the experts' forward can be captured in a CUDA graph: their grouping never waits for the device, and
    torch._grouped_mm reads its offsets on the device for bf16 on sm90 (its CUTLASS kernel), where elsewhere it
    loops over them copied to the host."""
    return (dtype == torch.bfloat16 and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


class ExpertGroups:
    """A routing's (token, slot) pairs grouped by expert for torch._grouped_mm: `order` lists them (indices into
    topk_ids.flatten()) so that each expert's pairs form one contiguous segment, ending at its entry of `offsets`.
    A slot whose id is num_experts or more (a LongCat-Flash zero expert) sorts after every segment: grouped_mm
    leaves its rows unwritten, and scatter gives them as zeros."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int):
        self.flat, self.top_k, self.num_experts = topk_ids.flatten(), topk_ids.shape[1], num_experts
        self.order = self.flat.argsort(stable=True)
        # Counted into a fixed num_experts + 1 bins (ids past the experts share the last), not with torch.bincount,
        # which on CUDA reads the largest id back to size its output: nothing here waits for the device.
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=self.flat.device).scatter_add_(
            0, self.flat.clamp(max=num_experts), torch.ones_like(self.flat))[:num_experts]
        self.offsets = counts.cumsum(0).to(torch.int32)

    def expert_ids(self) -> torch.Tensor:
        """Each sorted pair's expert."""
        return self.flat[self.order]

    def token_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, ...] -> each sorted pair's token's row."""
        return x[self.order // self.top_k]

    def pair_rows(self, values: torch.Tensor) -> torch.Tensor:
        """values [tokens, k, ...] -> each sorted pair's."""
        return values.flatten(0, 1)[self.order]

    def linear(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Sorted rows [pairs, in] through their experts' weight [experts, out, in] -> [pairs, out]."""
        if pad := -rows.shape[1] % (16 // rows.element_size()):
            # grouped_mm takes row strides in whole 16 bytes: zero columns, which add nothing (odd shapes only: a
            # copy of the experts' weights per call).
            rows, weight = F.pad(rows, (0, pad)), F.pad(weight, (0, pad))
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=self.offsets)

    def scatter(self, y: torch.Tensor, skipped: bool = False) -> torch.Tensor:
        """Sorted pairs' rows -> [tokens, k, ...] in (token, slot) order (a sum over slots needs no atomics); with
        `skipped`, the rows of slots beyond the experts (left unwritten by grouped_mm) as zeros."""
        if skipped:
            y = torch.where((self.expert_ids() < self.num_experts)[:, None], y, 0)
        return torch.empty_like(y).index_copy_(0, self.order, y).view(-1, self.top_k, *y.shape[1:])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: GatedActivation = silu_and_mul, apply_router_weight_on_input: bool = False,
                  skipped: bool = False,
                  expert_norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [tokens, hidden]; w13 [experts, 2 * inter, hidden] (gate rows, then up rows; or, non-gated, up rows alone:
    [experts, inter, hidden]); w2 [experts, hidden, inter];
    topk_* [tokens, k] -> sum over each token's k experts of weight * down(activation(gate(x), up(x))), or, with
    apply_router_weight_on_input, of down(activation(gate(weight * x), up(weight * x))); the optional biases
    [experts, 2 * inter] and [experts, hidden] added after each projection. With `skipped`, slots whose id is the
    number of experts or more add nothing and cost nothing (LongCat-Flash's zero experts; no biases then). In 16-bit
    models as transformers' experts (its grouped_mm path) do: each output times its weight in the wider of the two
    dtypes (fp32 where the router's weights are fp32), each token's k products summed in its top-k order
    accumulating in fp32, rounded once to x's dtype. expert_norm: (each pair's output, its expert) -> what its
    weight then scales (Ergo's norm per expert)."""
    groups = ExpertGroups(topk_ids, w13.shape[0])
    weights = groups.pair_rows(topk_weights).unsqueeze(1)
    rows = groups.token_rows(x)
    if apply_router_weight_on_input:
        rows = rows * weights
    gate_up = groups.linear(rows, w13)
    if w13_bias is not None:
        gate_up += w13_bias[groups.expert_ids()]
    y = groups.linear(activation(*gate_up.chunk(w13.shape[1] // w2.shape[2], dim=-1)), w2)
    if w2_bias is not None:
        y += w2_bias[groups.expert_ids()]
    if expert_norm is not None:
        y = expert_norm(y, groups.expert_ids())
    if not apply_router_weight_on_input:
        y = y.to(torch.promote_types(y.dtype, weights.dtype)).mul_(weights)
    return groups.scatter(y, skipped).sum(dim=1).to(x.dtype)


class FusedMoE(nn.Module):
    """forward(x [tokens, hidden], router_logits [tokens, num_experts]) -> [tokens, hidden]. Weights w13_weight
    [experts, 2 * inter/tp, hidden] and w2_weight [experts, hidden, inter/tp], sharded like a MergedColumn /
    RowParallelLinear pair, and with bias, w13_bias [experts, 2 * inter/tp] and w2_bias [experts, hidden] (added
    by rank 0 alone). With reduce_results=False the caller all-reduces (e.g. after adding a shared expert).
    gated=False: experts without a gate (w13 holds the up rows alone), `activation` taking the up projection.
    apply_router_weight_on_input: the routing weights scale each expert's input rather than its output (Llama 4).
    stacked_transposed: the family's stacked checkpoint tensors are always [experts, in, out] (Llama 4), also where
    hidden = 2 * inter makes the gate/up tensor's shape read either way.
    fp32_weights: forward's routing weights left in fp32 in 16-bit models (see select_experts)."""
    skips_zero_experts = False  # routed ids from num_experts on add nothing (see fused_experts: LongCat-Flash's)

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 reduce_results: bool = True, bias: bool = False, activation: GatedActivation = silu_and_mul,
                 gated: bool = True, apply_router_weight_on_input: bool = False, stacked_transposed: bool = False,
                 fp32_weights: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by the "
                             f"tensor-parallel size {self.tp_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize, self.reduce_results = (num_experts, top_k, renormalize,
                                                                               reduce_results)
        self.intermediate_size, self.gated = intermediate_size, gated
        self.apply_router_weight_on_input, self.stacked_transposed = apply_router_weight_on_input, stacked_transposed
        self.fp32_weights = fp32_weights
        inter, projections = intermediate_size // self.tp_size, 2 if gated else 1
        self.w13_weight = nn.Parameter(torch.empty(num_experts, projections * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.w13_weight.num_shards = projections * num_experts  # the loader checks that every expert's gate, up arrived
        self.w2_weight.num_shards = num_experts
        self.w13_bias = self.w2_bias = None
        if bias:  # stacked in checkpoints (no per-expert shard ids): complete once loaded whole
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.activation = activation

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int | None, str] | None = None) -> None:
        """One expert's full gate_proj/up_proj [inter, hidden] or down_proj [hidden, inter] from the checkpoint, or
        (shard_id None) all experts' stacked: gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden,
        inter] and their biases, or (expert None) all experts' gate, up or down in DBRX's layout (see load_flat)."""
        if shard_id is None:
            self.load_stacked(param, loaded)
            return
        expert, proj = shard_id
        if expert is None:
            self.load_flat(param, loaded, proj)
            return
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts} experts")
        dim = 1 if proj == "down" else 0
        if loaded.dim() != 2 or loaded.shape[dim] != self.intermediate_size:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, expected "
                             f"{self.intermediate_size} along dim {dim}")
        inter = self.intermediate_size // self.tp_size
        dest = param.data[expert]
        if proj == "gate" and not self.gated:
            raise ValueError("a gate_proj for experts without a gate")
        if proj != "down":
            dest = dest.narrow(0, inter if proj == "up" and self.gated else 0, inter)
        copy_weight(dest, loaded.narrow(dim, self.tp_rank * inter, inter))

    def load_flat(self, param: nn.Parameter, loaded: torch.Tensor, proj: str) -> None:
        """DBRX's w1 / v1 / w2: every expert's gate / up / down rows stacked, [experts * inter, hidden] (the down
        projection transposed), loaded expert by expert."""
        inter, hidden = self.intermediate_size, self.w2_weight.shape[1]
        if list(loaded.shape) != [self.num_experts * inter, hidden]:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, expected "
                             f"({self.num_experts * inter}, {hidden}) ({self.num_experts} experts x {inter})")
        for expert in range(self.num_experts):
            rows = loaded.narrow(0, expert * inter, inter)
            self.weight_loader(param, rows.t() if proj == "down" else rows, (expert, proj))

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """All experts' tensor for `param` in transformers' layout (see _STACKED_EXPERTS): this rank's slice of the
        intermediate dimension, gate and up halves apart; the down projection's bias whole."""
        full, inter = self.intermediate_size, self.intermediate_size // self.tp_size
        projections = 2 if self.gated else 1
        expected = list(param.shape)
        if param is self.w2_weight:
            expected[2] = full
        elif param is not self.w2_bias:  # w13's weight or bias: gate rows, then up rows (or up rows alone)
            expected[1] = projections * full
        # Qwen3-VL-MoE's Hub files hold each expert's weight transposed ([experts, hidden, 2 * inter], [experts,
        # inter, hidden]); transformers tells the layouts apart by shape alone, as here, unless the family says.
        shape = list(loaded.shape)
        transposed = (len(shape) == 3 and shape == [expected[0], expected[2], expected[1]]
                      and (shape != expected or self.stacked_transposed))
        if shape != expected and not transposed:
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(shape)}, expected {tuple(expected)}")
        if param is self.w2_bias:
            copy_weight(param, loaded)
            return
        inter_dim = 2 if (param is self.w2_weight) != transposed else 1  # where the intermediate size is

        def part(start: int) -> torch.Tensor:
            chunk = loaded.narrow(inter_dim, start, inter)
            return chunk.transpose(1, 2) if transposed else chunk

        start = self.tp_rank * inter
        if param is self.w2_weight:
            copy_weight(param.data, part(start))
        else:
            for half in range(projections):  # this rank's gate rows, then its up rows
                copy_weight(param.data.narrow(1, half * inter, inter), part(half * full + start))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.run_experts(x, *select_experts(router_logits, self.top_k, self.renormalize, self.fp32_weights))

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts of a routing made elsewhere (DeepSeek's), weighted, summed and (unless reduce_results is
        False) all-reduced."""
        # The down projection's bias once in the sum over ranks.
        w2_bias = self.w2_bias if self.tp_rank == 0 else None
        y = fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_bias, w2_bias,
                          self.activation, self.apply_router_weight_on_input, self.skips_zero_experts)
        if self.reduce_results and self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y


class Fp32Router(nn.Module):
    """A replicated router scoring in fp32 in every model dtype, as transformers' DeepSeek, ERNIE, Hunyuan MoE and
    Flint routers do: the input and the weight upcast, fp32 logits. The weight in the model's dtype (Kolibri-1's), or
    (fp32_weight) kept in fp32 where transformers keeps the checkpoint's fp32 weight in 16-bit models (ERNIE's,
    Hunyuan MoE's, Flint's, and since 5.25 DeepSeek's): rounded to bf16 first, the logits move and near-ties choose
    other experts."""

    def __init__(self, hidden_size: int, num_experts: int, fp32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                               dtype=torch.float32 if fp32_weight else None), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SparseMoeBlock(nn.Module):
    """An MoE layer's routed MLP: a replicated router (`gate`) scores the experts, each token goes to its top k."""

    def __init__(self, config: PretrainedConfig, num_experts: int, intermediate_size: int, renormalize: bool,
                 top_k: int | None = None, fp32_weights: bool = False, fp32_router: bool = False):
        """top_k: experts per token; None: config.num_experts_per_tok. fp32_weights: see FusedMoE. fp32_router: the
        router's weight kept in fp32 and its logits fp32 (Fp32Router), so the routing weights too."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.gate = (Fp32Router(config.hidden_size, num_experts, fp32_weight=True) if fp32_router
                     else ReplicatedLinear(config.hidden_size, num_experts))  # the router
        self.experts = FusedMoE(num_experts, top_k or config.num_experts_per_tok, config.hidden_size,
                                intermediate_size, renormalize, fp32_weights=fp32_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
