"""Gemma 3n (text): Gemma 4's E2B/E4B attention and per-layer embeddings (gemma4.py: unscaled scores, (w) q/k norms, a
weightless value norm, sliding and full layers with their own ropes, the last `num_kv_shared_layers` layers attending
over an earlier layer's keys and values) inside AltUp: the residual stream is `altup_num_inputs` parallel streams
(the embedding and its learned projections, rescaled to its magnitude). Each layer predicts every stream from a
mix of all of them (coefficients from a router reading the active one), runs on the active prediction alone, adds
LAuReL's low-rank residual to the attention's, and corrects every stream by the layer's innovation, weighted by the
router again; the per-layer input's branch, gated by the scaled active stream, joins the other streams. The streams
are projected back and averaged before the final norm. MLPs may be sparse: the gate keeps only what exceeds a
Gaussian estimate of its top (1 - p) quantile (mean + std * icdf(p) over the row)."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import OlmoRMSNorm, rms_normalize
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models import gemma2, gemma4
from nanoinfer.models.llama import LlamaMLP, MLPFactory, OptionsFactory
from nanoinfer.utils.dist import tp_group, tp_size


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    gemma2.check_layer_types(config)
    gemma4.check_kv_sharing(config)
    if not config.hidden_size_per_layer_input:
        raise ValueError(f"hidden_size_per_layer_input={config.hidden_size_per_layer_input} in the model config: "
                         "Gemma 3n without per-layer inputs is not supported")
    if not 0 <= config.altup_active_idx < config.altup_num_inputs:
        raise ValueError(f"altup_active_idx={config.altup_active_idx} in the model config: not one of the "
                         f"altup_num_inputs={config.altup_num_inputs} streams")
    media = getattr(config, "media_token_configs", {})
    if "vision_config" in media and "audio_config" in media:  # transformers: vision ids up to the audio ones
        vision, audio = media["vision_config"], media["audio_config"]
        if vision.vocab_offset + vision.vocab_size != audio.vocab_offset:
            raise ValueError(f"vision_config.vocab_offset={vision.vocab_offset} + vocab_size={vision.vocab_size} in "
                             f"the model config: the vision ids do not end where the audio ids "
                             f"(from {audio.vocab_offset}) start")
    for i, sparsity in enumerate(config.activation_sparsity_pattern):
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"activation_sparsity_pattern[{i}]={sparsity} in the model config: expected a fraction "
                             "in [0, 1)")


def magnitude(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5


def rescaled(x: torch.Tensor, target_magnitude: torch.Tensor) -> torch.Tensor:
    """x with each token's RMS set to target_magnitude's (op for op as transformers' stream projections)."""
    return x * target_magnitude / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))


class Gemma3nMLP(LlamaMLP):
    """Gemma's GeLU-tanh MLP; with the layer's activation sparsity p > 0, the gate row becomes relu(gate - cutoff),
    cutoff = mean + std * icdf(p) of the whole row. Under tensor parallelism each rank holds part of the row: the
    sums behind its mean and (population) std are all-reduced, two floats per token."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        width = config.intermediate_size[layer_idx]
        super().__init__(config, width, config.hidden_activation)
        self.width = width
        sparsity = config.activation_sparsity_pattern[layer_idx]
        self.std_multiplier: float | None = None
        if sparsity > 0.0:
            # transformers: torch's normal icdf in fp32, rounded to the model's dtype (the one this is built under).
            icdf = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32))
            self.std_multiplier = icdf.to(torch.get_default_dtype()).item()
            self.act = get_act(config.hidden_activation)
            self.tp_size, self.tp_group = tp_size(), tp_group()

    def cutoff(self, gate: torch.Tensor) -> torch.Tensor:
        """mean + std * icdf(p) over each row of gate [tokens, width / ranks] -> [tokens, 1]."""
        if self.tp_size == 1:
            mean, std = torch.mean(gate, dim=-1, keepdim=True), torch.std(gate, dim=-1, keepdim=True, unbiased=False)
            return mean + std * self.std_multiplier
        total = gate.sum(-1, keepdim=True)
        dist.all_reduce(total, group=self.tp_group)
        mean = total / self.width
        squares = (gate - mean).square().sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.tp_group)
        return mean + (squares / self.width).sqrt() * self.std_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.std_multiplier is None:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.act(F.relu(gate - self.cutoff(gate))) * up)


class AltUp(nn.Module):
    """Alternating updates over the streams [streams, tokens, hidden]: predict mixes them by per-token coefficients
    (from the router's tanh of the active stream, RMS-normed and scaled by 1 / hidden), correct adds the layer's
    innovation (its output minus the active prediction) to every stream, weighted by 1 + coefficients of the router
    on that output. `altup_coef_clip` clamps the coefficients' weights in training only (transformers too): not
    applied. All of it is small and replicated on every rank."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        n, hidden = config.altup_num_inputs, config.hidden_size
        self.num_streams, self.active = n, config.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.correction_coefs = ReplicatedLinear(n, n)
        self.prediction_coefs = ReplicatedLinear(n, n * n)
        self.modality_router = ReplicatedLinear(hidden, n)
        self.router_norm = OlmoRMSNorm(hidden, config.rms_norm_eps)
        # transformers keeps 1 / hidden as a buffer in the model's dtype.
        self.router_input_scale = torch.tensor(hidden ** -1.0, dtype=torch.get_default_dtype(), device="cpu").item()

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] -> the router's [tokens, streams], tanh in fp32."""
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Stream i plus sum_j c[i, j] * stream j, c per token."""
        n = self.num_streams
        coefs = self.prediction_coefs(self.modalities(streams[self.active])).view(-1, n, n)
        # [tokens, hidden, n] @ [tokens, n (j), n (i)], as transformers multiplies them.
        mixed = torch.matmul(streams.permute(1, 2, 0), coefs.transpose(1, 2)).permute(2, 0, 1)
        return (mixed + streams).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Every prediction plus (1 + c_i) times the innovation of the active one, c per token."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        innovation = activated - predictions[self.active]
        return innovation * coefs.T.unsqueeze(-1) + predictions


class Laurel(nn.Module):
    """LAuReL, the learned augmented residual: x + norm(right(left(x))) through `laurel_rank` features; small, and
    replicated on every rank."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.linear_left = ReplicatedLinear(config.hidden_size, config.laurel_rank)
        self.linear_right = ReplicatedLinear(config.laurel_rank, config.hidden_size)
        self.post_laurel_norm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nDecoderLayer(gemma4.PerLayerInputDecoderLayer):
    """Gemma 4's layer parts run on AltUp's active prediction; it hands the next layer all the corrected streams."""

    def __init__(self, config: PretrainedConfig, options: gemma4.Gemma4AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.altup = AltUp(config)
        self.laurel = Laurel(config)
        self.active, self.correct_scale = config.altup_active_idx, config.altup_correct_scale

    def forward(self, positions: torch.Tensor | None, streams: torch.Tensor, per_layer_input: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """streams [streams, tokens, hidden]; per_layer_input [tokens, width]: this layer's."""
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        x = self.input_layernorm(active)
        laurel = self.laurel(x)
        attn = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x = (active + attn + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        # Into every stream but the first (the active one included), as transformers adds it.
        corrected[1:] += self.per_layer_branch(first, per_layer_input)
        return corrected


class MediaTokenEmbedder(nn.Module):
    """Gemma3nForConditionalGeneration's embedding of the ids from a media sub-config's `vocab_offset` on (image
    and audio placeholders, their delimiters; transformers' Gemma3nMultimodalEmbedder on ids): a table of their own,
    normed, projected to the text's width and normed without a weight. Small, and replicated but for the table."""

    def __init__(self, media_config: PretrainedConfig, hidden_size: int):
        super().__init__()
        self.vocab_offset, self.eps = media_config.vocab_offset, media_config.rms_norm_eps
        self.vocab_end = self.vocab_offset + media_config.vocab_size
        self.embedding = VocabParallelEmbedding(media_config.vocab_size, media_config.hidden_size)
        self.hard_embedding_norm = OlmoRMSNorm(media_config.hidden_size, self.eps)
        self.embedding_projection = ReplicatedLinear(media_config.hidden_size, hidden_size)

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """embeddings [tokens, hidden] with the rows of this embedder's ids replaced (computed for every token:
        the same work at every step, which CUDA graphs need)."""
        ids = input_ids.clamp(self.vocab_offset, self.vocab_end - 1) - self.vocab_offset
        own = rms_normalize(self.embedding_projection(self.hard_embedding_norm(self.embedding(ids))), self.eps)
        mine = (input_ids >= self.vocab_offset) & (input_ids < self.vocab_end)
        return torch.where(mine.unsqueeze(-1), own.to(embeddings.dtype), embeddings)


class Gemma3nModel(gemma4.Gemma4Model):
    """The streams: the scaled embedding and its `altup_num_inputs - 1` projections, each rescaled to the
    embedding's RMS; after the layers, the other streams' unembedding projections rescaled to the first's RMS, and
    the mean of all. The projections (hidden x hidden each) are replicated: the rescaling needs whole rows. Read
    from Gemma3nForConditionalGeneration's checkpoint, media token ids take the wrapper's embeddings."""

    decoder_layer = Gemma3nDecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        hidden, extra = config.hidden_size, config.altup_num_inputs - 1
        self.altup_projections = nn.ModuleList(ReplicatedLinear(hidden, hidden) for _ in range(extra))
        self.altup_unembed_projections = nn.ModuleList(ReplicatedLinear(hidden, hidden) for _ in range(extra))
        media = getattr(config, "media_token_configs", {})
        self.embed_vision = MediaTokenEmbedder(media["vision_config"], hidden) if "vision_config" in media else None
        self.embed_audio = MediaTokenEmbedder(media["audio_config"], hidden) if "audio_config" in media else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = super().embed(input_ids, positions)
        for embedder in (self.embed_vision, self.embed_audio):
            if embedder is not None:
                x = embedder(input_ids, x)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        per_layer = self.per_layer_embeddings(input_ids, x)
        target = magnitude(x)
        streams = torch.stack([x, *(rescaled(project(x), target) for project in self.altup_projections)])
        for i, layer in enumerate(self.layers):
            streams = layer(positions, streams, per_layer[:, i], meta)
        target = magnitude(streams[0])
        unembedded = (rescaled(project(s), target) for project, s in zip(self.altup_unembed_projections, streams[1:]))
        return self.norm(torch.stack([streams[0], *unembedded]).mean(0))


class Gemma3nForCausalLM(gemma2.Gemma2ForCausalLM):
    """Checkpoints keep k_proj/v_proj/k_norm of the layers reusing others' keys and values; transformers ignores
    them, and so does this. Gemma3nForConditionalGeneration softcaps its logits as the text model does."""

    model_class = Gemma3nModel
    weight_name_substitutions = gemma4.PER_LAYER_EMBEDDING_NAMES
    wrapper_scales_logits = True
    check_config = staticmethod(check_config)
    attention_options = staticmethod(gemma4.kv_sharing_attention_options)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # The media embedders' norm of soft tokens (encoder outputs), which text never reaches.
        self.ignored_weight_suffixes = gemma4.reused_kv_weight_suffixes(config) + (".soft_embedding_norm.weight",)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Gemma3nMLP(config, layer_idx)
