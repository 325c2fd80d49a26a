"""Turns last-position logits into next tokens where the logits are (CPU or GPU): structured outputs' grammar
bitmask, allowed_token_ids, bad words, min_tokens, logit_bias, penalties, greedy, temperature, min_p, top-k and top-p
(vLLM v1's order and definitions), per-request seeds as counter-based noise, and the top-k logprobs of the raw
distribution (after the grammar bitmask, as in vLLM)."""
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cuda import triton_sampling
from nanoinfer.logits_processor import LogitsProcessor

MASK32 = 0xFFFFFFFF
# vLLM's logprobs_mode: the log-softmax or the values of the logits as the model gives them (after a grammar's mask)
# or as the row samples from them (after penalties, bans and custom processors; then, unless every row of the step is
# greedy, temperature (1 for greedy rows), min_p, argmax-invariant processors, top-k and top-p).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class Penalties:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties of some rows."""
    rows: torch.Tensor  # [R] batch rows these apply to
    repetition: torch.Tensor  # [R]
    presence: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]
    prompt_mask: torch.Tensor  # [R, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [R, V] float: how often the token was generated


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor  # [B]; 0 means greedy
    top_k: torch.Tensor | None  # [B]; <= 0 or >= V disables; None when no row uses it
    top_p: torch.Tensor | None  # [B]; 1 disables; None when no row uses it
    all_greedy: bool  # known on the host, so that nothing waits for the device to decide
    all_random: bool = False  # no greedy row: the argmax of the plain logits is not needed
    noise_keys: torch.Tensor | None = None  # [B, 2] int64 (see noise_keys); None when all rows are greedy
    min_p: torch.Tensor | None = None  # [B]; None when no row uses it
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) banned: min_tokens, bad words
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [R], [R, V] bool: outside allowed_token_ids)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows [R], ids [R, W], biases [R, W])
    num_logprobs: int | None = None  # the most top logprobs any row asks for; None: no logprobs
    # (rows [R], [R, ceil(V / 32)] int32): bit t % 32 of word t // 32 set where the row's grammar allows token t
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    # The largest k top_k enables, known on the host, where no row has top-p without top-k: every row's cuts then
    # need only that many of its largest logits ranked; None: the cuts sort the vocabulary.
    max_top_k: int | None = None
    # Custom logits processors (see nanoinfer/logits_processor.py), whose rows are these: those that may change a
    # row's argmax, run for every row after logit_bias; the argmax-invariant ones, run for random rows after min_p.
    logits_processors: tuple[LogitsProcessor, ...] = ()
    argmax_invariant_processors: tuple[LogitsProcessor, ...] = ()
    logprobs_mode: str = "raw_logprobs"  # what logprobs report: one of LOGPROBS_MODES


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    # With logprobs, over the raw (unprocessed) distribution: the chosen token's logprob and rank, and the
    # top num_logprobs tokens with their logprobs.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] fp32; every result stays on the logits' device."""
        # As vLLM does, the grammar masks the logits before the sampler sees them: logprobs are those of the
        # masked distribution.
        raw = logits = apply_grammar_bitmask(logits, m.grammar_bitmask)
        logits = self.penalize(logits, m)
        tokens = None if m.all_random else greedy(logits)
        processed = m.num_logprobs is not None and m.logprobs_mode.startswith("processed")
        # Processed logprobs are those of what the rows draw from: warped here, then, not inside draw().
        warped = self.warp(logits, m) if processed and not m.all_greedy else None
        if not m.all_greedy:
            sampled = self.draw(logits, m, warped)
            tokens = sampled if tokens is None else torch.where(m.temperatures == 0, tokens, sampled)
        if m.num_logprobs is None:
            return SamplerOutput(tokens)
        reported = raw if not processed else logits if warped is None else warped  # see LOGPROBS_MODES
        return SamplerOutput(tokens, top_logprobs(reported, tokens, m.num_logprobs,
                                                  normalize=m.logprobs_mode.endswith("logprobs")))

    @staticmethod
    def penalize(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        """What greedy rows take the argmax of, in vLLM v1's order: allowed_token_ids, bad words and min_tokens
        (-inf masks: their order does not matter), then logit_bias, then custom logits processors, then
        repetition, frequency and presence penalties (the bias moves a logit before the penalties scale or lower it;
        a banned token stays -inf)."""
        if (m.banned is None and m.penalties is None and m.disallowed is None and m.logit_bias is None
                and not m.logits_processors):
            return logits
        logits = logits.clone()  # the raw logits stay as they are for logprobs (processors may work in place)
        if m.disallowed is not None:
            rows, disallowed = m.disallowed
            logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
        if m.banned is not None:
            # A device scalar: a Python one is made on the CPU and copied blocking by index_put_ on CUDA.
            logits.index_put_(m.banned, logits.new_full((), float("-inf")))
        if m.logit_bias is not None:
            rows, ids, biases = m.logit_bias
            # Padding pairs add 0.0 to token 0; a token's one real bias is added exactly once.
            add_at(logits, rows.unsqueeze(1) * logits.shape[1] + ids, biases)
        for processor in m.logits_processors:
            logits = processor.apply(logits)
        if (p := m.penalties) is not None:
            rows = logits[p.rows]
            seen = p.prompt_mask | (p.output_counts > 0)
            rep = p.repetition.unsqueeze(1)
            rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
            rows -= p.frequency.unsqueeze(1) * p.output_counts + p.presence.unsqueeze(1) * (p.output_counts > 0)
            logits[p.rows] = rows
        return logits

    def draw(self, logits: torch.Tensor, m: SamplingMetadata, warped: torch.Tensor | None = None) -> torch.Tensor:
        """A token per row from softmax(warp(logits)) (warped: that warp, if already taken) by an exponential race:
        argmax p / E with E ~ Exp(1) per token. A row's noise is a hash of its own key (seed, position) and the token
        id, so its token does not depend on the rest of the batch. On CUDA one Triton pass takes argmax log p - log E
        (the same race in logs), dividing by the temperatures itself unless min_p, top-k or top-p need the scaled
        logits first."""
        kernels = triton_sampling() if logits.device.type == "cuda" else None
        if (kernels is not None and warped is None and m.min_p is None and m.top_k is None and m.top_p is None
                and not m.argmax_invariant_processors):
            return kernels.gumbel_max(logits, m.temperatures, m.noise_keys)
        warped = self.warp(logits, m) if warped is None else warped
        if kernels is not None:
            return kernels.gumbel_max(warped, None, m.noise_keys)
        return exponential_race(torch.softmax(warped, -1), m.noise_keys)

    @staticmethod
    def warp(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min_p and argmax-invariant custom logits processors, then top-k and top-p: softmax of
        the result is what a sampled row draws from."""
        # Greedy rows (temperature 0) as at temperature 1, as vLLM scales them: their warp is only reported (see
        # LOGPROBS_MODES), their token is the argmax.
        logits = logits / torch.where(m.temperatures == 0, 1.0, m.temperatures.clamp_min(1e-6)).unsqueeze(1)
        if m.min_p is not None:
            probs = logits.softmax(-1)
            drop = probs < m.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(drop, float("-inf"))
        for processor in m.argmax_invariant_processors:
            logits = processor.apply(logits)
        if m.top_k is None and m.top_p is None:
            return logits
        return _filter_top_k_top_p(logits, m.top_k, m.top_p, m.max_top_k)

    def processed_logits(self, logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        return self.warp(self.penalize(apply_grammar_bitmask(logits, m.grammar_bitmask), m), m)


def filtering_metadata(rows: int, device: torch.device) -> SamplingMetadata:
    """Rows drawn with every [rows, vocab] filter (min_p, then top-k and top-p: a sort of the vocabulary) and their
    logprobs, for a warm-up to meet the sampler's largest temporaries."""
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)
    return SamplingMetadata(temperatures=full(1.0), top_k=full(2, torch.long), top_p=full(0.9), all_greedy=False,
                            all_random=True, noise_keys=torch.zeros(rows, 2, dtype=torch.long, device=device),
                            min_p=full(0.05), num_logprobs=1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """-inf where the rows' packed bitmasks leave a token's bit unset (a copy; the logits as they are without)."""
    if bitmask is None:
        return logits
    rows, words = bitmask
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits


def verify_drafts(token_ids: torch.Tensor, draft_ids: torch.Tensor, seq_index: torch.Tensor, offsets: torch.Tensor,
                  num_seqs: int) -> torch.Tensor:
    """Rejection sampling of deterministic drafts, for [R] rows of num_seqs sequences (seq_index: each row's sequence,
    offsets: its place there): the number of each sequence's leading drafts accepted. A row's token was sampled from
    the target distribution p at its position, as a plain step would sample it there (same noise key); draft_ids holds
    the draft made for that position, -1 at each sequence's last row. A draft is accepted where it equals that token:
    with probability p(d); else the sampled token, which given a rejection is distributed as p without d,
    renormalized, is what the sequence emits there. This is the rejection rule min(1, p/q) for a draft
    distribution q that puts all its mass on d, and the emitted tokens are exactly those a plain run samples."""
    missed = torch.where(token_ids == draft_ids, len(offsets), offsets)  # a Python scalar: no host-to-device copy
    first_miss = torch.full((num_seqs,), len(offsets), dtype=offsets.dtype, device=offsets.device)
    return first_miss.scatter_reduce_(0, seq_index, missed, "amin")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through the C kernel for fp32 CPU tensors (torch's is single-threaded there)."""
    return cpu_kernels.argmax(logits) if cpu_kernels.use_cpu_kernels(logits) else logits.argmax(-1)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, normalize: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits) (the logits themselves without normalize) at token_ids [B], their ranks (1 = most likely),
    and the top-k ids and values."""
    logprobs = logits.log_softmax(-1) if normalize else logits
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs >= chosen).sum(-1)
    top = logprobs.topk(k, -1)
    return chosen.squeeze(-1), ranks, top.indices, top.values


def noise_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[B, 2] int64 keys of the noise rows (seed, position in the sequence): splitmix64 of both, split into 32-bit
    halves. The same (seed, position) always gets the same noise, whatever else is in the batch."""
    key = _splitmix64(seeds.astype(np.uint64) ^ _splitmix64(positions.astype(np.uint64)))
    return np.stack([key & np.uint64(MASK32), key >> np.uint64(32)], -1).astype(np.int64)


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax probs / E per row, E the rows' exponential_noise: a draw from probs [B, V]. For fp32 CPU tensors one
    C pass per row that never materialises E (the same quotients and argmax rule as the torch ops)."""
    if cpu_kernels.use_cpu_kernels(probs):
        return cpu_kernels.exponential_race(probs, keys)
    return probs.div_(exponential_noise(keys, probs.shape[-1])).argmax(-1)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab] (fp32) from a counter-based hash of (row key, token id): two rounds of a 32-bit mixer
    keyed by the key's halves, in int64 ops whose products never overflow (the same integers on every device; C
    on the CPU, torch ops elsewhere, and CUDA's race kernel hashes them itself). -log u may differ in the last bit
    between them: the C kernel rounds it correctly, torch's fp32 log is within 1 ulp."""
    if keys.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.exponential_noise(keys, vocab)
    x = _mix32(torch.arange(vocab, device=keys.device) ^ keys[:, :1])
    x = _mix32(x.bitwise_xor_(keys[:, 1:]))
    # The top 23 bits as a uniform in (0, 1), exact in fp32, never 0 or 1: E = -log(u) is finite and > 0. (With 24
    # bits, 2^24 - 1 + 0.5 rounds to 2^24: u = 1, E = -0.0, and p / E is NaN for a p = 0 token, which then won.)
    u = x.bitwise_right_shift_(9).float().add_(0.5).mul_(2.0 ** -23)
    return u.log_().neg_()


def compile_race(logits: torch.Tensor) -> None:
    """Has Triton compile the CUDA race kernel's two variants for a step's logits, so that no request waits for it:
    scaling these logits (strided as a step's) by the temperatures, and taking Sampler.warp's (contiguous) as they
    are. Nothing elsewhere."""
    if logits.device.type == "cuda" and (kernels := triton_sampling()) is not None:
        keys = torch.zeros(1, 2, dtype=torch.long, device=logits.device)
        kernels.gumbel_max(logits[:1], torch.ones(1, device=logits.device), keys)
        kernels.gumbel_max(logits[:1].contiguous(), None, keys)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (hash-prospector's lowbias32 shape) on int64 values in [0, 2^32): its multipliers
    are below 2^31, so every product fits in int64 and nothing relies on overflow."""
    x = x ^ (x >> 16)  # a new tensor; the rest works in place
    x.mul_(0x21F0AAAD).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(MASK32)
    x ^= x >> 15
    return x


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy's uint64 arithmetic wraps modulo 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def add_at(x: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    """x.view(-1)[flat_index] += values (broadcast to flat_index's shape) in place, repeated indices adding up. Not
    index_put_(accumulate=True): on CUDA that reads its indices' range back to the host (a sync that stalls the
    queue)."""
    x.view(-1).scatter_add_(0, flat_index.reshape(-1), values.to(x.dtype).broadcast_to(flat_index.shape).reshape(-1))


def _mask_below_kth(x: torch.Tensor, ranked: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """x with -inf below each row's k-th largest value, read from `ranked` (the row's largest values, descending, at
    least as many as any row keeps). By value, as vLLM and transformers cut: every token tied with the k-th largest
    stays (bf16 logits tie often, and a cut by rank would keep whichever the device's sort put first). Rows whose
    top_k is off (<= 0, or the whole vocabulary) are untouched."""
    use_k = (top_k > 0) & (top_k < x.shape[-1])
    kth = ranked.gather(-1, (top_k.clamp(1, ranked.shape[-1]) - 1).unsqueeze(1))
    return x.masked_fill(use_k.unsqueeze(1) & (x < kth), float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        max_top_k: int | None) -> torch.Tensor:
    """Top-k, then top-p over what top-k keeps, both cut by value, from each row's largest logits ranked (_ranked)."""
    # Without top-k, top-p's normaliser is these logits' log-sum-exp, which _ranked may need too: taken once.
    lse = logits.logsumexp(-1, keepdim=True) if top_p is not None and top_k is None else None
    ranked = _ranked(logits, top_k, top_p, max_top_k, lse)
    if top_k is not None:
        logits = _mask_below_kth(logits, ranked, top_k)
    return logits if top_p is None else _mask_below_top_p(logits, ranked, top_p, lse)


def _ranked(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None,
            lse: torch.Tensor | None) -> torch.Tensor:
    """Each row's largest logits, descending, as many as its cuts need: one topk of max_top_k where that suffices (no
    row has top-p without top-k: Qwen3's generation config, k = 20 and p = 0.95, for one); on the CPU, where reading
    values back costs no device sync, the fewest of 1,024 x 4^i that leave the last one outside every top-p row's set
    (at 64 x 151,936 on a 2-core EPYC a topk of 1,024 takes 16 ms, the sort 345 ms); else a sort of the vocabulary.
    lse: the logits' log-sum-exp, if already taken."""
    if max_top_k is not None:
        return logits.topk(max_top_k, -1).values
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and top_p is not None:
        with_k = torch.zeros_like(top_p, dtype=torch.bool) if top_k is None else (top_k > 0) & (top_k < vocab)
        width = max(1024, int(torch.where(with_k, top_k, 0).max()) if top_k is not None else 0)
        lse = logits.logsumexp(-1, keepdim=True) if lse is None else lse
        while width < vocab:
            ranked = logits.topk(width, -1).values
            # A row with top-k keeps at most `width` tokens (and those tied with them, by value); one without, its
            # set, if the last token ranked is outside it.
            if bool((with_k | (top_p >= 1) | ~_in_top_p(ranked, lse, top_p)[:, -1]).all()):
                return ranked
            width *= 4
    return logits.sort(-1, descending=True).values


def _in_top_p(ranked: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, W] bool: whether each ranked value (descending, a row's largest) is in its row's top-p set, the fewest
    largest values whose probabilities exp(value - lse) reach top_p: the mass ranked above it is below top_p (so the
    largest always is)."""
    probs = (ranked - lse).exp()
    return probs.cumsum(-1) - probs < top_p.unsqueeze(1)


def _mask_below_top_p(x: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """x with -inf below each row's top-p set (_in_top_p over x's softmax; lse: x's log-sum-exp, if already taken).
    By value, as _mask_below_kth cuts: every token tied with the smallest one kept stays. `ranked`: each row's
    largest values, descending, at least as many as its set holds; past x's finite values they may hold those a cut
    before top-p dropped, which can only lower this cut below it. Rows whose top_p is 1 are untouched."""
    lse = x.logsumexp(-1, keepdim=True) if lse is None else lse
    # At least the largest: a row that masks every token (min_tokens withholding the only allowed ones) has no set,
    # and index -1 would fail the gather for every row (on CUDA, a device assert that ends the process's context).
    kept = _in_top_p(ranked, lse, top_p).sum(-1, keepdim=True).clamp_min(1)
    return x.masked_fill((top_p < 1).unsqueeze(1) & (x < ranked.gather(-1, kept - 1)), float("-inf"))
