"""The n-gram (prompt-lookup) proposer: a decoding sequence's drafts are the tokens that followed the latest earlier
occurrence of its last n tokens in its prompt and output, for the longest n that occurs."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoinfer.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min
        # seq_id -> (its token ids in a growing array, how many are filled): a step copies only the new ones.
        self.contexts: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        """Up to `limit` drafts (never more than k) for the tokens that follow token_ids; [] when no n-gram of the
        allowed lengths recurs."""
        tokens = self._context(seq_id, token_ids)
        num_tokens = len(tokens)
        # Where an earlier occurrence may end: where the last token occurs, before the last position. Every
        # n-gram match ends at one of these, so one scan serves every n.
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

    def _context(self, seq_id: int, token_ids: list[int]) -> np.ndarray:
        """token_ids as an int64 array, kept per sequence (a sequence's tokens only ever grow) and extended by the
        tokens appended since the last call."""
        buffer, filled = self.contexts.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        if len(buffer) < len(token_ids):
            grown = np.empty(max(2 * len(token_ids), 256), dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled:len(token_ids)] = token_ids[filled:]
        self.contexts[seq_id] = buffer, len(token_ids)
        return buffer[:len(token_ids)]

    def forget(self, seq_id: int) -> None:
        """The sequence finished: drop its context."""
        self.contexts.pop(seq_id, None)
