"""HyperCLOVAX (NAVER's HyperCLOVA X SEED): Granite's decoder (granite.py) with an RMSNorm on each sublayer's output
(`use_post_norm`, Peri-LN) and the logits multiplied by `logits_scaling` (Granite divides by it)."""
import torch

from nanoinfer.models.granite import GraniteForCausalLM


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits * self.logits_scaling
