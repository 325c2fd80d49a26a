"""xLSTM (`xLSTMForCausalLM`, NX-AI/xLSTM-7b): no attention; every block a pre-norm mLSTM layer and a pre-norm gated
SiLU MLP, as transformers' native (torch) path computes them. The mLSTM keeps, per sequence and head, a matrix memory
C [qk_head_dim, v_head_dim], a normalizer n [qk_head_dim] and a stabilizer m (a running max of log gates) in a
recurrent-state slot of layers/recurrent.py, as Mamba does: prefix caching is refused, chunked prefill and preemption
carry or recompute the state exactly. Decode takes transformers' one-step update; a prompt chunk its parallel form
over blocks of tokens (the same sums, stabilized by the same running max). Input and forget gates are soft-capped,
the output gate a sigmoid, each head's output layer-normed; the logits are soft-capped. Under tensor parallelism each
rank holds its heads (q, k, v, the gates and the head norm by rows, out_proj by columns) and its MLP slice."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, load_rank_rows
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import LlamaMLP
from nanoinfer.utils.dist import tp_size

BLOCK_SIZE = 64  # tokens per block of the parallel form: its scores are [heads, block, block]


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    for name, supported in (("weight_mode", "single"), ("use_bias", False)):
        if getattr(config, name) != supported:
            raise ValueError(f"{name}={getattr(config, name)!r} in {where} is not supported; only {supported!r} is")
    if config.num_heads % tp_size():
        raise ValueError(f"num_heads={config.num_heads} in {where} does not split over tensor_parallel_size="
                         f"{tp_size()}")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


def mlstm_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
               state: torch.Tensor, eps: float) -> torch.Tensor:
    """One token of each of S sequences, op for op as transformers' mlstm_recurrent_step_native: q, k [S, H, dk],
    v [S, H, dv], gate pre-activations i, f [S, H], state [S, H, dk + 1, dv + 1] (see state_views; updated in place)
    -> h [S, H, dv]."""
    C, n, m = state_views(state)
    f_log = F.logsigmoid(f)
    m_new = torch.maximum(f_log + m, i)
    f_act, i_act = torch.exp(f_log + m - m_new), torch.exp(i - m_new)
    q = q * q.shape[-1] ** -0.5
    C.copy_(f_act[..., None, None] * C + i_act[..., None, None] * (k[..., :, None] @ v[..., None, :]))
    n.copy_(f_act[..., None] * n + i_act[..., None] * k)
    m.copy_(m_new)
    numerator = (q[..., None, :] @ C).squeeze(-2)
    qn = (q[..., None, :] @ n[..., :, None]).squeeze(-1)
    return numerator / (torch.maximum(qn.abs(), torch.exp(-m_new)[..., None]) + eps)


def mlstm_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                state: torch.Tensor, eps: float) -> torch.Tensor:
    """The t tokens of one sequence at once, heads first: q, k [H, t, dk], v [H, t, dv], i, f [H, t], state [H, dk
    + 1, dv + 1] (updated in place) -> h [H, t, dv]. Token s reaches token u >= s with log weight i_s + the forget
    gates' log-sigmoids after it; the state carried in with m + all of them up to u; each token's stabilizer is the
    largest of these, which is the recurrence's running max."""
    C, n, m = state_views(state)
    f_cum = F.logsigmoid(f).cumsum(-1)  # [H, t]
    log_weights = f_cum[:, :, None] - f_cum[:, None, :] + i[:, None, :]  # [H, u, s]
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    log_weights = log_weights.masked_fill(~causal, -torch.inf)
    log_carried = f_cum + m[:, None]  # [H, t]
    m_all = torch.maximum(log_weights.amax(-1), log_carried)
    weights, carried = torch.exp(log_weights - m_all[..., None]), torch.exp(log_carried - m_all)
    q = q * q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * weights
    numerator = scores @ v + carried[..., None] * (q @ C)
    qn = scores.sum(-1) + carried * (q @ n[..., None]).squeeze(-1)
    h = numerator / (torch.maximum(qn.abs(), torch.exp(-m_all)) + eps)[..., None]
    last, carried_last = weights[:, -1, :, None], carried[:, -1, None]  # [H, t, 1], [H, 1]
    C.copy_((k * last).transpose(-1, -2) @ v + carried_last[..., None] * C)
    n.copy_((k * last).sum(-2) + carried_last * n)
    m.copy_(m_all[:, -1])
    return h


def state_views(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slot's state [..., dk + 1, dv + 1] as its parts, views into it: C [..., dk, dv], n [..., dk] (the last
    column) and m [...] (the last row's first entry), so one tensor per layer holds all three."""
    return state[..., :-1, :-1], state[..., :-1, -1], state[..., -1, 0]


def mlstm_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
                   state: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of one sequence ([n, H, ...]) in blocks of BLOCK_SIZE, the state carried across them ->
    (h [n, H, dv], the state after the last token)."""
    state = state.clone()
    q, k, v, i, f = (t.transpose(0, 1) for t in (q, k, v, i, f))
    h = [mlstm_block(*(t[:, s:s + BLOCK_SIZE] for t in (q, k, v, i, f)), state, eps)
         for s in range(0, q.shape[1], BLOCK_SIZE)]
    return torch.cat(h, 1).transpose(0, 1), state


class HeadNormWeight(nn.Module):
    """The weight of the per-head LayerNorm, flat over all heads as checkpoints store it: this rank's heads'."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_rows(param, loaded)


class MLSTMLayer(RecurrentLayer):
    """transformers' xLSTMLayer ("single" weights); each rank holds its heads."""

    def __init__(self, config: PretrainedConfig):
        hidden, heads = config.hidden_size, config.num_heads
        qk_dim, v_dim = int(hidden * config.qk_dim_factor), int(hidden * config.v_dim_factor)
        self.num_heads, self.qk_head_dim, self.v_head_dim = heads // tp_size(), qk_dim // heads, v_dim // heads
        # No conv; the state packs C, n and m (state_views).
        super().__init__(1, 0, (self.num_heads, self.qk_head_dim + 1, self.v_head_dim + 1))
        self.q = ColumnParallelLinear(hidden, qk_dim, False)
        self.k = ColumnParallelLinear(hidden, qk_dim, False)
        self.v = ColumnParallelLinear(hidden, v_dim, False)
        self.ogate_preact = ColumnParallelLinear(hidden, v_dim, False)
        self.igate_preact = ColumnParallelLinear(hidden, heads, True)
        self.fgate_preact = ColumnParallelLinear(hidden, heads, True)
        self.multihead_norm = HeadNormWeight(v_dim // tp_size())
        self.out_proj = RowParallelLinear(v_dim, hidden, False)
        self.gate_soft_cap, self.eps, self.norm_eps = config.gate_soft_cap, config.eps, config.norm_eps

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        dtype = self.ssm_state.dtype  # the state's (fp32 at least): transformers' inference_state_dtype
        q = self.q(x).view(-1, self.num_heads, self.qk_head_dim).to(dtype)
        k = self.k(x).view(-1, self.num_heads, self.qk_head_dim).to(dtype)
        v = self.v(x).view(-1, self.num_heads, self.v_head_dim).to(dtype)
        i = soft_cap(self.igate_preact(x), self.gate_soft_cap).to(dtype)
        f = soft_cap(self.fgate_preact(x), self.gate_soft_cap).to(dtype)
        h = self.scan(batch, lambda *t: mlstm_step(*t, self.eps), lambda *t: mlstm_sequence(*t, self.eps),
                      q, k, v, i, f)
        h = F.layer_norm(h, (self.v_head_dim,), eps=self.norm_eps).to(x.dtype).flatten(1)
        return self.out_proj(torch.sigmoid(self.ogate_preact(x)) * (h * self.multihead_norm.weight))


def mlp_width(config: PretrainedConfig) -> int:
    """transformers' round_up_to_next_multiple_of(hidden_size * ffn_proj_factor, ffn_round_up_to_multiple_of)."""
    multiple = config.ffn_round_up_to_multiple_of
    return int((config.hidden_size * config.ffn_proj_factor + multiple - 1) // multiple * multiple)


class xLSTMForCausalLM(HybridForCausalLM):
    packed_modules_mapping = {"proj_up_gate": ("gate_up_proj", 0), "proj_up": ("gate_up_proj", 1)}
    weight_name_substitutions = {
        "^backbone.embeddings.": "model.embed_tokens.",
        "^backbone.out_norm.": "model.norm.",
        "^backbone.blocks.": "model.layers.",
        ".norm_mlstm.": ".input_layernorm.",
        ".norm_ffn.": ".post_attention_layernorm.",
        ".mlstm_layer.": ".mixer.",
        ".ffn.proj_down.": ".mlp.down_proj.",
        ".ffn.": ".mlp.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return HybridDecoderLayer(config, MLSTMLayer(config), False, LlamaMLP(config, mlp_width(config), "silu", False),
                                  config.norm_eps)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config, config.norm_eps, logit_softcap=config.output_logit_soft_cap)
