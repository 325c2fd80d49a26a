"""Falcon-Mamba (`FalconMambaForCausalLM`): Mamba with weightless RMS norms (`mixer_rms_eps`) on dt, B and C."""
from dataclasses import replace

from transformers import PretrainedConfig

from nanoinfer.layers.mamba import MambaSettings
from nanoinfer.models.mamba import MambaForCausalLM, mamba_settings


def falcon_mamba_settings(config: PretrainedConfig) -> MambaSettings:
    return replace(mamba_settings(config), dt_bc_norm_eps=config.mixer_rms_eps, dt_bc_norm_weights=False)


class FalconMambaForCausalLM(MambaForCausalLM):
    def settings(self, config: PretrainedConfig) -> MambaSettings:
        return falcon_mamba_settings(config)
