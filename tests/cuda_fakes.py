"""CPU stand-ins for the CUDA-only pieces, to drive the CUDA path's own code on the CPU.

This module doubles as `flash_attn` (tests put it in sys.modules): its two paged-attention entry points follow
flash-attn 2's documented contract (flash_attn_interface.py docstrings, flash_api.cpp checks), enforcing the
argument rules the CUDA build checks (int32 metadata, contiguous last dims, shapes, page size a multiple of
256) and computing the documented result in fp32 (causal mask and window aligned to the bottom right, GQA by
head groups, empty rows -> 0). RecordedGraph stands in for torch.cuda.CUDAGraph; HostSyncAudit finds what a CUDA graph
could not capture."""
import contextlib
import functools
import importlib
import importlib.util
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PAGE_MULTIPLE = 256
calls: list[dict] = []  # one record per call, for tests to see which path ran


class _Call:
    """One call a graph replays: fn again on the arguments it had at capture (tensors, and the host's values frozen as
    they were), its results copied into the tensors capture returned, which later calls read."""

    def __init__(self, fn, args, kwargs, out) -> None:
        self.fn, self.args, self.kwargs, self.out = fn, args, kwargs, out

    def __call__(self) -> None:
        _copy_into(self.out, self.fn(*self.args, **self.kwargs))


def _copy_into(old, new) -> None:
    if isinstance(old, torch.Tensor):
        if new is not old and new.data_ptr() != old.data_ptr():  # not the same memory (in place ops, views)
            old.copy_(new)
    elif isinstance(old, (tuple, list)):
        for o, n in zip(old, new, strict=True):
            _copy_into(o, n)


class _Recording(TorchDispatchMode):
    """Records every tensor op (and, through kernel(), each kernel call) of a capture; the ops inside a kernel call
    are that kernel's, not recorded apart."""
    active: "_Recording | None" = None

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.inside_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside_kernel:
            self.calls.append(_Call(func, args, kwargs, out))
        return out

    def __enter__(self):
        _Recording.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        _Recording.active = None
        return super().__exit__(*exc)


def kernel(fn):
    """fn as one call of a capture: a C kernel, a Triton launch or a stand-in for a CUDA library call, which on a GPU
    reads its tensors' values on the device at each replay (the Python around it runs at capture only)."""
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        recording = _Recording.active
        if recording is None or recording.inside_kernel:
            return fn(*args, **kwargs)
        recording.inside_kernel = True
        try:
            out = fn(*args, **kwargs)
        finally:
            recording.inside_kernel = False
        recording.calls.append(_Call(fn, args, kwargs, out))
        return out
    return recorded


def _check_int32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert t.dtype == torch.int32, f"{name} must have dtype int32, got {t.dtype}"
    assert t.is_contiguous(), f"{name} must be contiguous"
    assert tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}"


def _check_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, batch: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] % PAGE_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert block_table.dim() == 2 and block_table.shape[0] == batch, "block_table must be [batch, max_blocks]"


def _check_alibi(alibi_slopes: torch.Tensor | None, heads: int) -> None:
    """flash-attn's rule: fp32 slopes, one per head (nanoinfer never passes the per-sequence [batch, heads] form)."""
    if alibi_slopes is not None:
        assert alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32"
        assert alibi_slopes.stride(-1) == 1 and tuple(alibi_slopes.shape) == (heads,), "ALiBi slopes: [heads]"


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    blocks = table_row[:-(-length // cache.shape[1])]
    assert bool((blocks >= 0).all()) and bool((blocks < cache.shape[0]).all()), f"bad block ids {blocks.tolist()}"
    return cache[blocks.long()].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, softcap: float,
            window_size: tuple[int, int], alibi_slopes: torch.Tensor | None) -> torch.Tensor:
    """q [n, h, d], k, v [L, h_k, d] -> [n, h, d]; query j, at position L - n + j, may see keys 0 .. L - n + j when
    causal, and with window_size (left, right) those from its position - left to its position + right (-1: no limit
    on that side); softcap > 0 caps the scores to softcap * tanh(score / softcap); alibi_slopes [h] adds
    -slope * |query position - key position| to each score."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    assert heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query"
    if length == 0:
        return torch.zeros_like(q)
    group = heads // kv_heads
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos, q_pos = torch.arange(length)[None, :], torch.arange(n)[:, None] + (length - n)
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.view(-1, 1, 1) * (q_pos - k_pos).abs()
    left, right = window_size
    visible = k_pos <= q_pos if causal else torch.ones(n, length, dtype=torch.bool)
    if left >= 0:
        visible &= k_pos >= q_pos - left
    if right >= 0:
        visible &= k_pos <= q_pos + right
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a fully masked row outputs zeros
    return torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


@kernel
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    batch = cu_seqlens_q.numel() - 1
    assert batch > 0 and q.dim() == 3
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    assert q.dtype == k.dtype == v.dtype
    assert dropout_p == 0.0
    _check_alibi(alibi_slopes, q.shape[1])
    _check_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _check_int32("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    if block_table is not None:
        _check_paged(k, v, block_table, batch)
    else:
        assert k.dim() == 3 and k.shape[0] == cu_seqlens_k[-1], "k must hold total_k rows"
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i in range(batch):
        n, length = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        assert n <= max_seqlen_q and length <= max_seqlen_k, "max_seqlen_q/k smaller than a sequence"
        if block_table is not None:
            ks, vs = _gather(k, block_table[i], length), _gather(v, block_table[i], length)
        else:
            ks, vs = k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        out[cq[i]:cq[i + 1]] = _attend(q[cq[i]:cq[i + 1]], ks, vs, scale, causal, softcap, window_size, alibi_slopes)
    calls.append(dict(fn="varlen", paged=block_table is not None, batch=batch))
    return out


@kernel
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    assert q.dim() == 4, "q must be [batch, seqlen, heads, dim]"
    batch = q.shape[0]
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    _check_alibi(alibi_slopes, q.shape[2])
    assert block_table is not None, "nanoinfer always passes the paged cache"
    _check_paged(k_cache, v_cache, block_table, batch)
    assert isinstance(cache_seqlens, torch.Tensor)
    _check_int32("cache_seqlens", cache_seqlens, (batch,))
    assert cache_seqlens.max() <= block_table.shape[1] * k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i, length in enumerate(cache_seqlens.tolist()):
        ks, vs = _gather(k_cache, block_table[i], length), _gather(v_cache, block_table[i], length)
        out[i] = _attend(q[i], ks, vs, scale, causal, softcap, window_size, alibi_slopes)
    calls.append(dict(fn="kvcache", paged=True, batch=batch))
    return out


@contextlib.contextmanager
def _as_kernel(owner, name: str):
    fn = getattr(owner, name)
    setattr(owner, name, kernel(fn))
    try:
        yield
    finally:
        setattr(owner, name, fn)


class RecordedGraph:
    """torch.cuda.CUDAGraph's semantics on the CPU: capture runs the step once, recording each tensor op and each
    kernel call with its arguments; replay issues those calls again, and nothing else. No Python of the step runs at
    replay, so what it computed on the host at capture (a grid, a scalar, a choice, a tensor made from host data)
    stays as captured, as in a real graph; inputs not copied into the static buffers, or outputs not read from them,
    show up as wrong results."""

    def capture(self, fn, pool=None):
        with contextlib.ExitStack() as stack:
            stack.enter_context(_as_kernel(importlib.import_module("nanoinfer.kernels.cpu"), "_run"))
            if importlib.util.find_spec("triton") is not None:  # launches run in its interpreter on CPU tensors
                stack.enter_context(_as_kernel(importlib.import_module("triton.runtime.interpreter").GridExecutor,
                                               "__call__"))
            recording = stack.enter_context(_Recording())
            fn()
        self.calls = recording.calls
        return pool

    def replay(self) -> None:
        with torch.inference_mode():
            for call in self.calls:
                call()


def count_replays(monkeypatch) -> list[RecordedGraph]:
    """The graphs replayed from now on, one entry per replay, in order."""
    replays, replay = [], RecordedGraph.replay
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(self) or replay(self))
    return replays


def capture_recorded_graphs(runner) -> None:
    """What ModelRunner._capture_graphs does on CUDA, done on the CPU with RecordedGraph (the runner captures graphs
    only on a CUDA device): decode steps then go through the graph runner's static buffers and padding."""
    runner.graph_runner = runner.new_graph_runner(RecordedGraph)
    runner.graph_runner.capture()


aten = torch.ops.aten
# Ops that read a value back to the host on CUDA, or whose output shape depends on values (which CUDA learns only by
# reading them back): during a CUDA graph's capture each one raises ("operation not permitted when stream is
# capturing"). lift_fresh is torch.tensor(data), a copy from pageable host memory there.
_HOST_READ = "a value read on the host (item(), int(), bool())"
_HOST_SYNCS = {aten._local_scalar_dense.default: _HOST_READ, aten.item.default: _HOST_READ,  # item: in inference mode
               aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
               aten._unique2.default: "unique", aten.unique_consecutive.default: "unique_consecutive",
               aten.bincount.default: "bincount", aten.lift_fresh.default: "torch.tensor(data)"}
_REPEATS = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)  # the second: in inference mode
_INDEX_PUTS = (aten.index_put.default, aten.index_put_.default)
_BOOL_INDEXED = (aten.index.Tensor, *_INDEX_PUTS)


def _scalar_through_index(index, value) -> bool:
    """t[index] = value where CUDA syncs with the host (torch 2.11): a Python number becomes a CPU scalar there, which
    index_put_ with integer index tensors copies to the device blocking (a boolean mask takes masked_fill_: no copy)."""
    parts = index if isinstance(index, tuple) else (index,)
    return isinstance(value, (bool, int, float)) and any(
        isinstance(p, torch.Tensor) and p.dtype != torch.bool for p in parts)


class HostSyncAudit(TorchDispatchMode, TorchFunctionMode):
    """Inside `with audit:`, records (what, nanoinfer file:line) for each op above, each boolean-mask index, each
    tolist() and each Python scalar assigned through index tensors that nanoinfer's code runs, except inside
    `with audit.paused():` (code that stands in for CUDA's own)."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        self.found: list[tuple[str, str]] = []
        self.active = True

    def __enter__(self):
        TorchFunctionMode.__enter__(self)  # tolist() never reaches the dispatcher
        return TorchDispatchMode.__enter__(self)

    def __exit__(self, *exc):
        TorchDispatchMode.__exit__(self, *exc)
        return TorchFunctionMode.__exit__(self, *exc)

    @contextlib.contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def _record(self, what: str) -> None:
        ours = [f for f in traceback.extract_stack() if "/nanoinfer/" in f.filename]
        self.found.append((what, f"{ours[-1].filename.rsplit('/nanoinfer/', 1)[1]}:{ours[-1].lineno}" if ours else "?"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.active and func is torch.Tensor.tolist:
            self._record("tolist()")
        if self.active and func is torch.Tensor.__setitem__ and _scalar_through_index(*args[1:]):
            self._record("a Python scalar assigned through a tensor index")
        return func(*args, **(kwargs or {}))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            what = _HOST_SYNCS.get(func)
            if func in _REPEATS and kwargs.get("output_size") is None:
                what = "repeat_interleave without output_size"
            if func in _BOOL_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]):
                what = "boolean-mask indexing"
            if func in _INDEX_PUTS and (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
                what = "index_put_ with accumulate=True"  # CUDA reads the indices' min and max back to check them
            if what is not None:
                self._record(what)
        return func(*args, **kwargs)
