"""Checks of a checkpoint's config that the families share: a setting the engine cannot run is a ValueError naming
it, its value and where the config came from, never run differently from transformers."""
from transformers import PretrainedConfig


def config_source(config: PretrainedConfig) -> str:
    """Where the config came from, for error messages."""
    return config.name_or_path or "the model config"


def check_each_in(config: PretrainedConfig, field: str, allowed: tuple[str, ...]) -> None:
    """Every entry of the config's list `field` (layer_types, mlp_layer_types) is one of `allowed`."""
    for i, value in enumerate(getattr(config, field)):
        if value not in allowed:
            raise ValueError(f"{field}[{i}]={value!r} in {config_source(config)} is not supported; expected one of "
                             f"{allowed}")
