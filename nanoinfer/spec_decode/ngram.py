"""The n-gram (prompt-lookup) proposer: a decoding sequence's drafts are the tokens that followed the latest earlier
occurrence of its last n tokens in its prompt and output, for the longest n that occurs."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoinfer.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to `limit` drafts (never more than k) for the tokens that follow token_ids; [] when no n-gram of the
        allowed lengths recurs."""
        tokens = np.array(token_ids, dtype=np.int64)
        num_tokens = len(tokens)
        # Candidate starts of an earlier occurrence: where the last token occurs, before the last position.
        # Every longer n-gram match begins with one of these (ending there), so one scan serves every n.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not len(ends):
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            fit = ends[ends >= n - 1]
            window = sliding_window_view(tokens, n)[fit - (n - 1)]
            hits = fit[(window == tokens[num_tokens - n:]).all(1)]
            if len(hits):
                start = int(hits[-1]) + 1  # the latest occurrence: recent context predicts best
                return tokens[start:start + min(limit, self.k)].tolist()
        return []
