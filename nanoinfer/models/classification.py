"""Sequence classification (`*ForSequenceClassification`: label, reward and cross-encoder models): a causal LM's
decoder with transformers' `score` projection to `num_labels` in place of the LM head, read at a prompt's last token."""
from functools import cache

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.config import hidden_states_width
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import LlamaForCausalLM


class ForSequenceClassification(nn.Module):
    causal_lm: type[LlamaForCausalLM]  # whose decoder (attention options, MLPs, checkpoint names) this model has
    classifier_pooling = "last"  # the head reads each prompt's last token (see ModelRunner.classify)

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        lm = self.causal_lm
        if hasattr(lm, "check_config"):
            lm.check_config(config)
        self.model = lm.model_class(config, lm.attention_options, lm.make_mlp)
        if hasattr(lm, "config_packed_modules_mapping"):  # checkpoint names that depend on the config (StableLM's)
            self.packed_modules_mapping = lm.config_packed_modules_mapping(config)
        self.score = ReplicatedLinear(hidden_states_width(config), config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels]: the label logits of each row."""
        return self.score(hidden_states)


@cache
def sequence_classifier(causal_lm: type[LlamaForCausalLM]) -> type[ForSequenceClassification]:
    """The classification model over causal_lm's decoder; the checkpoint's names are causal_lm's."""
    name = causal_lm.__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel") + "ForSequenceClassification"
    attributes = {"causal_lm": causal_lm, "packed_modules_mapping": causal_lm.packed_modules_mapping,
                  "weight_name_substitutions": getattr(causal_lm, "weight_name_substitutions", {}),
                  "ignored_weight_suffixes": getattr(causal_lm, "ignored_weight_suffixes", ())}
    return type(name, (ForSequenceClassification,), attributes)
