"""The text of every token id as a character-level DFA sees it (byte-level BPE, SentencePiece pieces with byte
fallback, or plain pieces), and a trie of those texts that the allowed-token search walks."""
import json
from collections.abc import Callable
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

# A trie node: (children by character, ids of the tokens whose text ends here).
TrieNode = tuple[dict[str, "TrieNode"], list[int]]


class Vocabulary:
    """texts[i] is token i's text, or None where a DFA over characters cannot place it: special tokens, ids past
    the tokenizer's, empty texts, and tokens whose bytes are not valid UTF-8 on their own (a piece of a multi-byte
    character)."""

    def __init__(self, texts: list[str | None]):
        self.texts = texts
        self.trie: TrieNode = ({}, [])
        for token_id, text in enumerate(texts):
            if text:
                node = self.trie
                for ch in text:
                    node = node[0].setdefault(ch, ({}, []))
                node[1].append(token_id)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> "Vocabulary":
        return cls(token_texts(tokenizer, vocab_size))

    def __len__(self) -> int:
        return len(self.texts)


def token_texts(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[str | None]:
    """Each id's text (see Vocabulary), for ids [0, vocab_size)."""
    num = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(num)))
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items() if i < num}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    to_text = _piece_decoder(tokenizer)
    texts: list[str | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        texts[i] = added[i].content if i in added else to_text(piece)
    return texts


def _piece_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], str | None]:
    """piece -> text (None when its bytes are not UTF-8 on their own), after the tokenizer's decoder kind."""
    kinds = _decoder_types(tokenizer)
    if "ByteLevel" in kinds or hasattr(tokenizer, "byte_decoder"):
        return _byte_level_text
    if kinds & {"Metaspace", "ByteFallback"} or hasattr(tokenizer, "sp_model"):
        return _sentencepiece_text
    return lambda piece: piece


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    stack, types = [json.loads(backend.to_str()).get("decoder") or {}], set()
    while stack:
        decoder = stack.pop()
        types.add(decoder.get("type"))
        stack += decoder.get("decoders") or []
    return types


def _byte_level_text(piece: str) -> str | None:
    decoder = _unicode_to_byte()
    if any(ch not in decoder for ch in piece):
        return piece  # not a byte-level piece (an added token's plain text)
    return _utf8(bytes(decoder[ch] for ch in piece))


def _sentencepiece_text(piece: str) -> str | None:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return _utf8(bytes([int(piece[3:5], 16)]))
    return piece.replace("\u2581", " ")


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
