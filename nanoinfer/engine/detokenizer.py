"""Incremental detokenization: a completion's text grows by decoding only the tokens added since the last update
(vLLM's prefix and read offsets), with the same result as decoding the whole completion at once."""
from collections.abc import Callable

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


class IncrementalDetokenizer:
    def __init__(self, skip_special_tokens: bool, start: int = 0):
        self.skip_special_tokens = skip_special_tokens
        self.start = start  # the text is that of token_ids[start:] (a sequence's completion: no copy of it per step)
        self.text = ""
        # token_ids[prefix_offset:read_offset] (counted from start) decode to the end of `text`: the context the next
        # tokens are decoded in (so that spaces and merges come out as in a whole decode); tokens from read_offset on
        # are not in it.
        self.prefix_offset = self.read_offset = 0
        self.tokenizer: PreTrainedTokenizerBase | None = None  # the one `decode` is for
        self.decode: Callable[..., str] | None = None

    def update(self, tokenizer: PreTrainedTokenizerBase, token_ids: list[int], final: bool = False) -> str:
        """The text of token_ids[start:] (the whole completion so far). Text ending in an incomplete character waits
        for the tokens that complete it, unless final."""
        start, num_tokens = self.start, len(token_ids) - self.start
        if self.read_offset >= num_tokens:
            return self.text
        if tokenizer is not self.tokenizer:
            self.tokenizer, self.decode = tokenizer, decode_function(tokenizer)
        decode, skip, begin = self.decode, self.skip_special_tokens, start + self.prefix_offset
        prefix = decode(token_ids[begin:start + self.read_offset], skip) if self.read_offset > self.prefix_offset \
            else ""
        full = decode(token_ids[begin:], skip)
        if not full.startswith(prefix):  # a decoder whose output is not a concatenation: decode everything
            self.text = decode(token_ids[start:], skip)
        elif final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
        else:
            return self.text
        self.prefix_offset, self.read_offset = self.read_offset, num_tokens
        return self.text

    def truncate(self, length: int, num_tokens: int) -> None:
        """Keep the first `length` characters as the final text of num_tokens tokens (cut at a stop string)."""
        self.text = self.text[:length]
        self.prefix_offset = self.read_offset = num_tokens


def decode_function(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str]:
    """tokenizer.decode, or the Rust tokenizer's own decode where tokenizer.decode only calls it (a fast tokenizer
    that cleans up no spaces, its decoding not overridden): the same text at a quarter of the cost per call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (isinstance(backend, Tokenizer) and tokenizer.clean_up_tokenization_spaces is False
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode):
        return backend.decode
    return tokenizer.decode
