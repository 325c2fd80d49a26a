"""RWKV-4 (`RwkvForCausalLM`, e.g. RWKV/rwkv-4-169m-pile): no attention. Each block: x + time_mix(ln1(x)), then
+ channel_mix(ln2(.)) (layer 0 first LayerNorms the embedding: `pre_ln`). Both mixes read each token's input and the
previous token's (the token shift); the time mix's WKV is a per-channel decaying weighted average of the values,
kept per sequence as (numerator, denominator, running max exponent) in fp32, as transformers' loop; the channel mix is
sigmoid(r) * value(relu(key)^2). With `rescale_every` (transformers' inference mode), block b's two output
projections' weights are divided by 2^(b // rescale_every) and the stream halved after every rescale_every-th block:
powers of two, exact, but the LayerNorms' epsilon sees the smaller stream. The token shifts and the WKV state live in
recurrent-state slots; `context_length` bounds only transformers' CUDA kernel, not a sequence."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer, load_rank_rows
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.hybrid import HybridForCausalLM
from nanoinfer.utils.dist import tp_size

# transformers' starting running max of the WKV exponents: below any exponent, so the first token's weight is 1.
WKV_MAX_START = -1e30


def check_config(config: PretrainedConfig) -> None:
    """The widths transformers' state and the ranks' shares need."""
    where = config_source(config)
    if config.attention_hidden_size != config.hidden_size:  # transformers' state is hidden_size wide
        raise ValueError(f"attention_hidden_size={config.attention_hidden_size} in {where} is not supported; "
                         f"transformers' cached state needs it equal to hidden_size={config.hidden_size}")
    for name in ("attention_hidden_size", "intermediate_size"):
        if getattr(config, name) % tp_size():
            raise ValueError(f"{name}={getattr(config, name)} in {where} does not split over "
                             f"tensor_parallel_size={tp_size()}")


def wkv_token(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, num: torch.Tensor,
              den: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' loop body: k (fp32) and v [..., C], w (-exp(time_decay)) and u (time_first) [C] in fp32, the
    state's numerator, denominator and max exponent [..., C] in fp32 -> (wkv in v's dtype, the next three)."""
    current = k + u
    out_top = torch.maximum(top, current)
    e1, e2 = torch.exp(top - out_top), torch.exp(current - out_top)
    out = ((e1 * num + e2 * v) / (e1 * den + e2)).to(v.dtype)
    decayed = top + w
    new_top = torch.maximum(decayed, k)
    e1, e2 = torch.exp(decayed - new_top), torch.exp(k - new_top)
    return out, e1 * num + e2 * v, e1 * den + e2, new_top


def wkv_step(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, state: torch.Tensor
             ) -> torch.Tensor:
    """One token of each of S sequences: k, v [S, C], state [S, 3, C] (updated in place) -> wkv [S, C]."""
    out, *new = wkv_token(k.float(), v, w, u, *state.unbind(1))
    state.copy_(torch.stack(new, 1))
    return out


def wkv_sequence(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of one sequence, k, v [n, C], state [3, C] -> (wkv [n, C], the state after the last), token by
    token as transformers' loop. A closed form over chunks of L tokens (each token's exponents against its chunk's,
    the state carried from chunk to chunk) is exact too, but does L times the loop's arithmetic: on CPUs, at 768
    channels, no faster than this loop for L from 4 to 32."""
    num, den, top = state.unbind(0)
    k = k.float()
    out = torch.empty_like(v)
    for t in range(k.shape[0]):
        out[t], num, den, top = wkv_token(k[t], v[t], w, u, num, den, top)
    return out, torch.stack((num, den, top))


class TokenShiftLayer(RecurrentLayer):
    """A mix of RWKV: lerps between each token's input and the previous token's (time_mix_* [1, 1, hidden], whole on
    every rank), that previous input kept per sequence as a 2-tap conv's state."""
    mix_names: tuple[str, ...] = ()

    def __init__(self, hidden_size: int, ssm_state_shape: tuple[int, ...] | None = None):
        super().__init__(2, hidden_size, ssm_state_shape)
        for name in self.mix_names:
            setattr(self, f"time_mix_{name}", nn.Parameter(torch.empty(1, 1, hidden_size), requires_grad=False))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded)  # the lerp weights; per-channel parameters of a rank's share override this

    def lerps(self, x: torch.Tensor, batch: RecurrentBatch) -> list[torch.Tensor]:
        """x [tokens, hidden] -> x * mix + previous * (1 - mix) for each of mix_names, as transformers computes it."""
        shifted = self.causal_windows(x, batch)[..., 0]
        mixes = (getattr(self, f"time_mix_{name}").view(-1) for name in self.mix_names)
        return [x * mix + shifted * (1 - mix) for mix in mixes]


class RwkvSelfAttention(TokenShiftLayer):
    """The time mix. Under tensor parallelism each rank holds its channels: their key / value / receptance rows,
    time_decay, time_first and WKV state, and output's input columns (one all-reduce)."""
    mix_names = ("key", "value", "receptance")

    def __init__(self, config: PretrainedConfig):
        channels = config.attention_hidden_size // tp_size()
        super().__init__(config.hidden_size, (3, channels))
        self.key, self.value, self.receptance = (
            ColumnParallelLinear(config.hidden_size, config.attention_hidden_size) for _ in range(3))
        self.output = RowParallelLinear(config.attention_hidden_size, config.hidden_size)
        # fp32 whatever the model's dtype, as transformers keeps them (_keep_in_fp32_modules).
        self.time_decay, self.time_first = (
            nn.Parameter(torch.empty(channels, dtype=torch.float32), requires_grad=False) for _ in range(2))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.time_decay or param is self.time_first:
            load_rank_rows(param, loaded)
        else:
            super().weight_loader(param, loaded)

    def reset_fresh_slots(self, batch: RecurrentBatch) -> None:
        super().reset_fresh_slots(batch)
        if batch.fresh_slots.numel():
            self.ssm_state.select(1, 2).index_fill_(0, batch.fresh_slots, WKV_MAX_START)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        key, value, receptance = self.lerps(x, batch)
        w, u = -torch.exp(self.time_decay), self.time_first
        wkv = self.scan(batch, lambda k, v, state: wkv_step(k, v, w, u, state),
                        lambda k, v, state: wkv_sequence(k, v, w, u, state), self.key(key), self.value(value))
        return self.output(torch.sigmoid(self.receptance(receptance)) * wkv)


class RwkvFeedForward(TokenShiftLayer):
    """The channel mix: key and value sharded as an MLP's, receptance (hidden -> hidden, gating the all-reduced value)
    whole on every rank."""
    mix_names = ("key", "receptance")

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.hidden_size)
        self.key = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.value = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.receptance = ReplicatedLinear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        self.reset_fresh_slots(batch)
        key, receptance = self.lerps(x, batch)
        value = self.value(torch.square(torch.relu(self.key(key))))
        return torch.sigmoid(self.receptance(receptance)) * value


class RwkvBlock(nn.Module):
    """Called as HybridModel's layers are; passes on no separate residual stream (the whole one, halved where
    rescale_every says)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        every, eps = config.rescale_every, config.layer_norm_epsilon
        self.rescale = 2 ** (layer_idx // every) if every > 0 else 1
        self.halve = every > 0 and (layer_idx + 1) % every == 0
        self.pre_ln = LayerNorm(config.hidden_size, eps) if layer_idx == 0 else None
        self.ln1, self.ln2 = LayerNorm(config.hidden_size, eps), LayerNorm(config.hidden_size, eps)
        self.attention = RwkvSelfAttention(config)
        self.feed_forward = RwkvFeedForward(config)

    def rescale_weights(self) -> None:
        """Divide the output projections' weights by the block's power of two in the model's dtype, as transformers'
        _rescale_layers: in fp16 the undivided product can overflow where the divided one does not (what rescale_every
        is for), so dividing the output instead is not the same."""
        for linear in (self.attention.output, self.feed_forward.value):
            linear.weight.data.div_(self.rescale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: None, meta: AttentionMetadata,
                batch: RecurrentBatch) -> tuple[torch.Tensor, None]:
        if self.pre_ln is not None:
            x = self.pre_ln(x)
        x = x + self.attention(self.ln1(x), batch)
        x = x + self.feed_forward(self.ln2(x), batch)
        return (x / 2 if self.halve else x), None


class RwkvForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {"^rwkv.embeddings.": "model.embed_tokens.", "^rwkv.blocks.": "model.layers.",
                                 "^rwkv.ln_out.": "model.norm.", "^head.": "lm_head."}

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return RwkvBlock(config, layer_idx)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> LayerNorm:
        return LayerNorm(config.hidden_size)  # transformers' ln_out: nn.LayerNorm's default epsilon, not the config's

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config, config.layer_norm_epsilon)

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        """Once, before the linear layers repack their weights (ModelRunner visits this module first)."""
        for layer in self.model.layers:
            layer.rescale_weights()
