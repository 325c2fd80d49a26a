"""A regex compiled against a vocabulary: the tokens each DFA state allows (a walk of the vocabulary's trie that
prunes dead branches, cached per state as a packed bitmask), and each sequence's state as its tokens arrive."""
import numpy as np
from transformers import PreTrainedTokenizerBase

from nanoinfer.structured.params import StructuredOutputsParams
from nanoinfer.structured.regex import DEAD, DFA
from nanoinfer.structured.vocab import Vocabulary


class Grammar:
    """A DFA over a vocabulary's token texts. bitmask(state): bit t of word t // 32 is set when token t may come
    next (EOS aside: a sequence adds its own where the state accepts)."""

    def __init__(self, pattern: str, vocab: Vocabulary):
        self.dfa = DFA(pattern)
        self.vocab = vocab
        self.num_words = -(-len(vocab) // 32)
        self._bitmasks: dict[int, np.ndarray] = {}  # DFA state -> uint32 [num_words]
        self._any_token: dict[int, bool] = {}

    @property
    def start(self) -> int:
        return self.dfa.start

    def accepting(self, state: int) -> bool:
        return state != DEAD and self.dfa.accepting[state]

    def allowed_token_ids(self, state: int) -> list[int]:
        """The tokens whose whole text the DFA can read from state without dying: a depth-first walk of the trie
        that follows the DFA alongside and never enters a branch the DFA has left."""
        if state == DEAD:
            return []
        out: list[int] = []
        moves, step = self.dfa.moves, self.dfa.step
        stack = [(self.vocab.trie, state)]
        while stack:
            (children, _), s = stack.pop()
            follow = moves[s]
            for ch, child in children.items():
                t = follow.get(ch)
                if t is None:
                    t = step(s, ch)
                if t != DEAD:
                    out += child[1]
                    if child[0]:
                        stack.append((child, t))
        return out

    def bitmask(self, state: int) -> np.ndarray:
        mask = self._bitmasks.get(state)
        if mask is None:
            allowed = np.zeros(self.num_words * 32, dtype=bool)
            allowed[self.allowed_token_ids(state)] = True
            mask = self._bitmasks[state] = pack_bits(allowed)
            self._any_token[state] = bool(allowed.any())
        return mask

    def allows_any_token(self, state: int) -> bool:
        """Whether some token (EOS aside) may follow."""
        if state not in self._any_token:
            self.bitmask(state)
        return self._any_token[state]

    def advance(self, state: int, token_id: int) -> int:
        text = self.vocab.texts[token_id] if 0 <= token_id < len(self.vocab) else None
        return DEAD if text is None else self.dfa.walk(state, text)


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """bool [32 * k] -> uint32 [k], bit i of word w set for entry 32 * w + i."""
    return np.packbits(allowed, bitorder="little").view("<u4").astype(np.uint32)


class GrammarState:
    """One sequence's place in its grammar, following its completion tokens (it is a function of them: a preempted
    and recomputed sequence keeps it)."""

    __slots__ = ("grammar", "state", "num_tokens")

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.start
        self.num_tokens = 0  # completion tokens read so far

    def update(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Read the completion tokens (token_ids past the prompt) added since the last update."""
        for token in token_ids[num_prompt_tokens + self.num_tokens:]:
            self.state = self.grammar.advance(self.state, token)
        self.num_tokens = len(token_ids) - num_prompt_tokens

    def bitmask(self, eos_token_ids: frozenset[int], pending: tuple[int, ...] = ()) -> np.ndarray:
        """The tokens that may come next, the sequence's EOS ids included where the state accepts; after `pending`
        tokens, which the state does not keep (sampled, not yet read)."""
        state = self.state
        for token in pending:
            state = self.grammar.advance(state, token)
        mask = self.grammar.bitmask(state)
        if eos_token_ids and self.grammar.accepting(state):
            mask = mask.copy()
            for t in eos_token_ids:
                if t < 32 * len(mask):
                    mask[t >> 5] |= np.uint32(1 << (t & 31))
        return mask

    def exhausted(self, eos_allowed: bool) -> bool:
        """Whether nothing may be sampled next: no token continues the match, and EOS is not allowed (the match is
        incomplete, or min_tokens or ignore_eos withholds it)."""
        grammar, state = self.grammar, self.state
        return not grammar.allows_any_token(state) and not (eos_allowed and grammar.accepting(state))


class GrammarCache:
    """An engine's grammars by regex (compiled once, their per-state bitmasks kept), over its tokenizer's vocabulary
    (built at the first structured request)."""

    MAX_GRAMMARS = 64  # least recently used ones are dropped beyond this

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._vocab: Vocabulary | None = None
        self._grammars: dict[str, Grammar] = {}

    def get(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar of params; ValueError naming the argument and its value when it cannot be built."""
        if self.tokenizer is None:
            raise ValueError(f"{params.describe()} needs a tokenizer, and this model has none")
        pattern = params.pattern()
        grammar = self._grammars.pop(pattern, None)
        if grammar is None:
            if self._vocab is None:
                self._vocab = Vocabulary.from_tokenizer(self.tokenizer, self.vocab_size)
            try:
                grammar = Grammar(pattern, self._vocab)
            except ValueError as e:
                raise ValueError(f"{params.describe()}: {e}") from None
            if not grammar.allows_any_token(grammar.start) and not grammar.accepting(grammar.start):
                raise ValueError(f"{params.describe()}: no token of the vocabulary can start a match")
            if len(self._grammars) >= self.MAX_GRAMMARS:
                del self._grammars[next(iter(self._grammars))]
        self._grammars[pattern] = grammar  # last: the most recently used
        return grammar
