"""A practical regex subset with Python `re.fullmatch` semantics, compiled to a Thompson NFA and a DFA built lazily,
one (state, character) transition at a time: what structured outputs walk token texts with."""
from bisect import bisect_right
from dataclasses import dataclass

DEAD = -1  # the DFA state of no NFA state: nothing can follow


@dataclass(frozen=True)
class CharSet:
    """Characters given by code-point ranges and by the categories of \\d \\w \\s (each wanted or not, as in
    \\d / \\D), possibly negated as a whole ([^...], `.`)."""
    starts: tuple[int, ...] = ()  # sorted, non-overlapping ranges [starts[i], ends[i]]
    ends: tuple[int, ...] = ()
    categories: tuple[tuple[str, bool], ...] = ()  # ("d" | "w" | "s", True for \d, False for \D)
    negated: bool = False

    def __contains__(self, ch: str) -> bool:
        o = ord(ch)
        i = bisect_right(self.starts, o) - 1
        hit = (i >= 0 and o <= self.ends[i]) or any(_CATEGORIES[c](ch) == wanted for c, wanted in self.categories)
        return hit != self.negated

    @property
    def empty(self) -> bool:
        """Whether nothing matches, as far as the cases the parser can produce go: [^\\d\\D], [^\\x00-\\U0010ffff]."""
        if not self.negated:
            return not self.starts and not self.categories
        both = {c for c, wanted in self.categories if (c, not wanted) in self.categories}
        return bool(both) or self.starts[:1] == (0,) and self.ends[:1] == (0x10FFFF,)


_CATEGORIES = {"d": str.isdecimal, "w": lambda ch: ch.isalnum() or ch == "_", "s": str.isspace}


def char_set(ranges: list[tuple[int, int]], categories: tuple[tuple[str, bool], ...] = (),
             negated: bool = False) -> CharSet:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return CharSet(tuple(lo for lo, _ in merged), tuple(hi for _, hi in merged), categories, negated)


# The AST: ("set", CharSet) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max or None).
Node = tuple


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_UNSUPPORTED_ESCAPES = {"b": "the word boundary \\b", "B": "the non-boundary \\B", "A": "the anchor \\A",
                        "Z": "the anchor \\Z", "z": "the anchor \\z", "G": "\\G", "N": "named characters \\N{...}"}


class _Parser:
    """Recursive descent over the pattern; errors are ValueErrors saying what and where."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, what: str, at: int | None = None) -> ValueError:
        return ValueError(f"{what} at position {self.i if at is None else at}")

    def unsupported(self, what: str, at: int | None = None) -> ValueError:
        return self.error(f"{what} is not supported", at)

    def peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def parse(self) -> Node:
        if self.peek() == "^":  # fullmatch: a leading ^ and a trailing $ change nothing
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced parenthesis")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Node:
        items = []
        while self.i < len(self.p) and self.peek() not in "|)":
            if self.peek() == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else ("cat", items)

    def quantified(self, atom: Node) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if self.peek() == "?":  # lazy: the same strings match in full
            self.i += 1
        elif self.peek() == "+":
            raise self.unsupported("a possessive quantifier")
        if self.peek() in ("*", "+", "?") or self.peek() == "{" and self.brace_bounds() is not None:
            raise self.error("multiple repeat")
        return ("rep", atom, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if ch == "{" and (bounds := self.brace_bounds()) is not None:
            (lo, hi), self.i = bounds
            if hi is not None and lo > hi:
                raise self.error("min repeat greater than max repeat")
            return lo, hi
        return None

    def brace_bounds(self) -> tuple[tuple[int, int | None], int] | None:
        """{m}, {m,}, {,n}, {m,n}, {,} at the current position: the bounds and the position after them; None when the
        brace is a literal (as in Python)."""
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        body = self.p[self.i + 1:end]
        lo, comma, hi = body.partition(",")
        if not all(part == "" or part.isascii() and part.isdigit() for part in (lo, hi)) or not (lo or comma):
            return None
        if not comma:
            return (int(lo), int(lo)), end + 1
        return (int(lo) if lo else 0, int(hi) if hi else None), end + 1

    def atom(self) -> Node:
        ch, at = self.peek(), self.i
        if ch in ("*", "+", "?") or ch == "{" and self.brace_bounds() is not None:
            raise self.error("nothing to repeat")
        self.i += 1
        if ch == "(":
            return self.group(at)
        if ch == "[":
            return ("set", self.char_class(at))
        if ch == ".":
            return ("set", char_set([(10, 10)], negated=True))  # not DOTALL: any character but a newline
        if ch == "\\":
            return ("set", self.escape(in_class=False))
        if ch == "^":
            raise self.unsupported("the anchor ^ (except at the start)", at)
        if ch == "$":
            raise self.unsupported("the anchor $ (except at the end)", at)
        return ("set", _literal(ch))

    def group(self, at: int) -> Node:
        if self.peek() == "?":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) and (end := self.p.find(">", self.i)) > 0:
                self.i = end + 1
            else:
                kind = {"?=": "lookahead", "?!": "lookahead", "?<": "lookbehind", "?P=": "a backreference",
                        "?#": "a comment group", "?>": "an atomic group", "?(": "a conditional group"}
                what = next((v for k, v in kind.items() if self.p.startswith(k, self.i)), "an inline flag group")
                raise self.unsupported(what, at)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ), unterminated subpattern", at)
        self.i += 1
        return node

    def char_class(self, at: int) -> CharSet:
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        categories: list[tuple[str, bool]] = []
        first = True
        while True:
            ch = self.peek()
            if not ch:
                raise self.error("unterminated character set", at)
            if ch == "]" and not first:
                self.i += 1
                return char_set(ranges, tuple(categories), negated)
            first = False
            start = self.i
            lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.class_item()
                if isinstance(lo, tuple) or isinstance(hi, tuple) or lo > hi:
                    raise self.error(f"bad character range {self.p[start:self.i]}", start)
                ranges.append((lo, hi))
            elif isinstance(lo, tuple):
                categories.append(lo)
            else:
                ranges.append((lo, lo))

    def class_item(self) -> int | tuple[str, bool]:
        """A code point, or a category (\\d ...) inside a class."""
        ch = self.peek()
        self.i += 1
        if ch != "\\":
            return ord(ch)
        if self.peek() == "b":
            self.i += 1
            return 8  # backspace inside a class
        s = self.escape(in_class=True)
        if s.categories:
            return s.categories[0]
        return s.starts[0]

    def escape(self, in_class: bool) -> CharSet:
        """The escape after a backslash: one character, or a category (\\d, \\W, ...)."""
        at = self.i - 1
        ch = self.peek()
        if not ch:
            raise self.error("bad escape (end of pattern)", at)
        self.i += 1
        if ch.lower() in "dws" and ch.isascii():
            return char_set([], ((ch.lower(), ch.islower()),))
        if ch in _ESCAPES:
            return _literal(_ESCAPES[ch])
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.p[self.i:self.i + width]
            if len(digits) < width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"incomplete escape \\{ch}{digits}", at)
            self.i += width
            if int(digits, 16) > 0x10FFFF:
                raise self.error(f"bad escape \\{ch}{digits}", at)
            return _literal(chr(int(digits, 16)))
        if ch == "0":
            digits = ""
            while len(digits) < 2 and self.peek() in tuple("01234567"):
                digits += self.peek()
                self.i += 1
            return _literal(chr(int(digits or "0", 8)))
        if ch.isdigit() and ch.isascii():
            raise self.unsupported("a backreference (or octal escape)", at)
        if ch in _UNSUPPORTED_ESCAPES and not in_class:
            raise self.unsupported(_UNSUPPORTED_ESCAPES[ch], at)
        if ch.isascii() and ch.isalnum():
            raise self.error(f"bad escape \\{ch}", at)
        return _literal(ch)


def _literal(ch: str) -> CharSet:
    return char_set([(ord(ch), ord(ch))])


def parse(pattern: str) -> Node:
    """The AST of pattern; ValueError naming what is unsupported or malformed, and where."""
    return _Parser(pattern).parse()


def escape(text: str) -> str:
    """text as a pattern matching exactly it."""
    return "".join("\\" + ch if ch in _SPECIAL else ch for ch in text)


_SPECIAL = frozenset("\\.^$*+?{}[]()|-#&~ \t\n\r\v\f")


class NFA:
    """Thompson's construction: per state its character edges [(CharSet, target)] and epsilon edges; one start, one
    accepting state. States that cannot reach the accepting state are cut off (so the DFA's only dead state is the
    empty set)."""

    def __init__(self, node: Node):
        self.edges: list[list[tuple[CharSet, int]]] = []
        self.eps: list[list[int]] = []
        self.start, self.accept = self._build(node)
        self._prune()

    def _new(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def _build(self, node: Node) -> tuple[int, int]:
        kind = node[0]
        if kind == "set":
            s, e = self._new(), self._new()
            if not node[1].empty:
                self.edges[s].append((node[1], e))
            return s, e
        if kind == "cat":
            s = e = self._new()
            for child in node[1]:
                cs, ce = self._build(child)
                self.eps[e].append(cs)
                e = ce
            return s, e
        if kind == "alt":
            s, e = self._new(), self._new()
            for child in node[1]:
                cs, ce = self._build(child)
                self.eps[s].append(cs)
                self.eps[ce].append(e)
            return s, e
        _, child, lo, hi = node
        s = e = self._new()
        for _ in range(lo):  # the required copies
            cs, ce = self._build(child)
            self.eps[e].append(cs)
            e = ce
        if hi is None:  # then any number more
            cs, ce = self._build(child)
            self.eps[e].append(cs)
            self.eps[ce].append(e)
            return s, e
        end = self._new()
        for _ in range(hi - lo):  # each optional copy may end the repetition
            self.eps[e].append(end)
            cs, ce = self._build(child)
            self.eps[e].append(cs)
            e = ce
        self.eps[e].append(end)
        return s, end

    def _prune(self) -> None:
        back: list[list[int]] = [[] for _ in self.edges]
        for s, (edges, eps) in enumerate(zip(self.edges, self.eps)):
            for t in eps + [t for _, t in edges]:
                back[t].append(s)
        alive, stack = {self.accept}, [self.accept]
        while stack:
            for s in back[stack.pop()]:
                if s not in alive:
                    alive.add(s)
                    stack.append(s)
        self.edges = [[(c, t) for c, t in edges if t in alive] for edges in self.edges]
        self.eps = [[t for t in eps if t in alive] for eps in self.eps]
        self.empty = self.start not in alive

    def closure(self, states: set[int]) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(s for s in seen if self.edges[s] or s == self.accept)  # only what can consume or accept


class DFA:
    """The subset construction, one transition at a time: states are ints for frozensets of NFA states;
    moves[state] caches {character: next state} (DEAD when no NFA state survives)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.nfa = NFA(parse(pattern))
        if self.nfa.empty:
            raise ValueError("it matches no string")
        self.sets: list[frozenset[int]] = []
        self.ids: dict[frozenset[int], int] = {}
        self.moves: list[dict[str, int]] = []
        self.accepting: list[bool] = []
        self.start = self._state(self.nfa.closure({self.nfa.start}))

    def _state(self, nfa_states: frozenset[int]) -> int:
        if not nfa_states:
            return DEAD
        state = self.ids.get(nfa_states)
        if state is None:
            state = self.ids[nfa_states] = len(self.sets)
            self.sets.append(nfa_states)
            self.moves.append({})
            self.accepting.append(self.nfa.accept in nfa_states)
        return state

    def step(self, state: int, ch: str) -> int:
        moves = self.moves[state]
        nxt = moves.get(ch)
        if nxt is None:
            edges = self.nfa.edges
            targets = {t for s in self.sets[state] for cs, t in edges[s] if ch in cs}
            nxt = moves[ch] = self._state(self.nfa.closure(targets))
        return nxt

    def walk(self, state: int, text: str) -> int:
        for ch in text:
            if state == DEAD:
                break
            state = self.step(state, ch)
        return state

    def fullmatch(self, text: str) -> bool:
        state = self.walk(self.start, text)
        return state != DEAD and self.accepting[state]

    def viable(self, text: str) -> bool:
        """Whether text is a prefix of some match (re's partial matching)."""
        return self.walk(self.start, text) != DEAD
