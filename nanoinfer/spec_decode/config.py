"""`speculative_config` (vLLM's keys) checked into a SpeculativeConfig, and the drafted/accepted token counters."""
from dataclasses import dataclass

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # k: drafts proposed per sequence and step, at most
    prompt_lookup_max: int  # the longest n-gram looked up
    prompt_lookup_min: int  # the shortest


def parse_speculative_config(config: dict | None) -> SpeculativeConfig | None:
    """vLLM's rules: method "ngram" and num_speculative_tokens are required; an unset lookup bound takes the
    other's value, and both unset are 5."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(f"speculative_config must be a dict or None, got {type(config).__name__}")
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (value {config[unknown[0]]!r}); "
                         f"known: {list(KEYS)}")
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method={method!r} is not supported; use one of {list(METHODS)}")
    if config.get("num_speculative_tokens") is None:
        raise ValueError("speculative_config: num_speculative_tokens is required with method='ngram'")
    for name in KEYS[1:]:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"speculative_config: {name}={value!r} must be an int >= 1")
    lookup_max, lookup_min = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = 5
    lookup_max = lookup_min if lookup_max is None else lookup_max
    lookup_min = lookup_max if lookup_min is None else lookup_min
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config: prompt_lookup_min={lookup_min} must be <= "
                         f"prompt_lookup_max={lookup_max}")
    return SpeculativeConfig(config["num_speculative_tokens"], lookup_max, lookup_min)


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: steps in which a sequence had drafts, draft tokens verified, and how many of
    them the target model accepted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted sequence step: the accepted drafts plus the token the target sampled."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
