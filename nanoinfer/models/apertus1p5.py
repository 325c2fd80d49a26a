"""Apertus 1.5's text model (`Apertus1p5TextForCausalLM`, `apertus1p5_text`): Apertus (apertus.py) over a vocabulary
extended with visual and audio codes, its LM head pruned to the first `output_vocab_size` ids where the config says
so (the text ones: the codes are input-only). The ids past the head get logits of -inf, so none is ever sampled and
the logits keep the vocabulary's width (the sampler's masks, logprobs and structured outputs are sized by it)."""
import math

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from nanoinfer.models.apertus import ApertusForCausalLM


class Apertus1p5TextForCausalLM(ApertusForCausalLM):
    @staticmethod
    def lm_head_rows(config: PretrainedConfig) -> int:
        return getattr(config, "output_vocab_size", None) or config.vocab_size

    def __init__(self, config: PretrainedConfig):
        rows = self.lm_head_rows(config)
        if not 0 < rows <= config.vocab_size or rows < config.vocab_size and config.tie_word_embeddings:
            raise ValueError(f"output_vocab_size={rows} in the model config: expected at most vocab_size="
                             f"{config.vocab_size}, and a pruned head untied (tie_word_embeddings=False)")
        super().__init__(config)
        self.vocab_size = config.vocab_size

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=-math.inf)
