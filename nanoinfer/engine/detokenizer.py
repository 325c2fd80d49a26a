"""Incremental detokenization: a completion's text grows by decoding only the tokens added since the last update
(vLLM's prefix and read offsets), with the same result as decoding the whole completion at once."""
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, skip_special_tokens: bool):
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # token_ids[prefix_offset:read_offset] decode to the end of `text`: the context the next tokens are decoded
        # in (so that spaces and merges come out as in a whole decode); tokens from read_offset on are not in it.
        self.prefix_offset = self.read_offset = 0

    def update(self, tokenizer: PreTrainedTokenizerBase, token_ids: list[int], final: bool = False) -> str:
        """The text of token_ids (the whole completion so far). Text ending in an incomplete character waits for
        the tokens that complete it, unless final."""
        if self.read_offset >= len(token_ids):
            return self.text
        prefix = self._decode(tokenizer, token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(tokenizer, token_ids[self.prefix_offset:])
        if not full.startswith(prefix):  # a decoder whose output is not a concatenation: decode everything
            self.text = self._decode(tokenizer, token_ids)
        elif final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
        else:
            return self.text
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self.text

    def truncate(self, length: int, num_tokens: int) -> None:
        """Keep the first `length` characters as the final text of num_tokens tokens (cut at a stop string)."""
        self.text = self.text[:length]
        self.prefix_offset = self.read_offset = num_tokens

    def _decode(self, tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""
