"""Builds a step's model inputs from scheduled sequences, runs the model over the paged KV cache, samples.
With tensor parallelism there is one per rank: rank 0's builds the inputs and samples, the others serve its steps."""
import logging
import os
import random
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from torch import nn

from nanoinfer.config import Config, hidden_states_width
from nanoinfer.engine import cuda_graph
from nanoinfer.engine.cuda_graph import CUDAGraph, CUDAGraphRunner
from nanoinfer.engine.gpu_memory import profile_kv_cache_blocks, settled_mem_info, state_bytes_for_gpu
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.engine.logits_processors import CustomLogitsProcessors
from nanoinfer.engine.parallel import TPGroup
from nanoinfer.engine.pooling import pool
from nanoinfer.engine.sampling_state import (ALLOWED_TOKENS, BAD_WORDS, GREEDY, LOGIT_BIAS, LOGPROBS, MIN_P,
                                              MIN_TOKENS, PENALIZED, STRUCTURED, TOP_K, TOP_P, HostStaging,
                                              HostTransfer, PenaltyCache, Results, TokenTables, bad_word_bans,
                                              grammar_bitmask)
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention import Attention, AttentionMetadata, get_backend
from nanoinfer.layers.attention.selector import resolve_device
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.fused_moe import FusedMoE, experts_capturable
from nanoinfer.layers.recurrent import RecurrentLayer
from nanoinfer.layers.rotary_embedding import shared_rope_tables
from nanoinfer.layers.sampler import (Penalties, Sampler, SamplerOutput, SamplingMetadata, compile_race,
                                      filtering_metadata, noise_keys, top_logprobs, verify_drafts)
from nanoinfer.lora.model import LoRAModel
from nanoinfer.lora.slots import LoRAMapping, LoRASlots
from nanoinfer.models.registry import get_model_class, is_classifier, is_encoder
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.utils.dist import tp_scope
from nanoinfer.utils.gguf_loader import iter_gguf_weights
from nanoinfer.utils.loader import iter_safetensors, load_weights, safetensors_names
from nanoinfer.utils.memory import keep_freed_memory
from nanoinfer.utils.quantization import dequantized_weights, quant_scheme

logger = logging.getLogger(__name__)

# Without num_kvcache_blocks, the cache holds max_num_seqs full-length sequences, within 4 GiB (the default
# of vLLM's CPU backend) and 30% of available memory: it is zero-filled, so every byte is really committed.
KV_CACHE_MAX_BYTES = 4 << 30
KV_CACHE_MEMORY_FRACTION = 0.3


# A position's logprobs: (token ids, logprobs, ranks), the chosen or actual token first, then the top k.
TokenLogprobs = tuple[list[int], list[float], list[int]]


@dataclass
class RunnerOutput:
    token_ids: list[int | None]  # per scheduled sequence
    logprobs: list[TokenLogprobs | None] | None = None  # per scheduled sequence, when some asked for them
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None  # per scheduled sequence: this step's
    # A step with drafts: per scheduled sequence, the accepted tokens emitted after token_ids[i], and their logprobs.
    extra_token_ids: list[list[int]] | None = None
    extra_logprobs: list[list[TokenLogprobs]] | None = None


class Step(NamedTuple):
    """A forward pass, as rank 0 sends it to the other ranks: prepare()'s host tensors, the hidden rows whose logits
    are computed (the num_sampled sampled ones first, then those owed prompt logprobs), the tokens' adapters."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: list[int]
    num_sampled: int
    lora_mapping: LoRAMapping | None = None
    # Rank 0 took some input ids from the tokens sampled on its device (InputBatch.feed_sampled): with tensor
    # parallelism the other ranks receive the step's ids from it, over the model's group.
    fed: bool = False
    # Tokens given as prompt embeddings: (their indices among the step's tokens, values) (see InputBatch).
    prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None


T = TypeVar("T")


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device (ModelRunner.launch), with what collect() needs to turn its results
    into a RunnerOutput once they reach the host."""
    batch: ScheduledBatch
    sampled: list[int]  # the batch indices of the sampled sequences
    prompt_rows: list[tuple[int, int, int]]  # see ModelRunner._prompt_logit_rows
    results: Results | None = None  # sampled tokens, their logprobs, prompt logprobs, accepted-draft counts
    num_sampled_parts: int = 0  # results' tensors that are sampled tokens and their logprobs (0: none sampled)
    # A step with drafts: the last token each sampled sequence emits (on the device) and its first row (see _verify).
    verified: tuple[torch.Tensor, np.ndarray] | None = None


@dataclass
class EncodeStep:
    """A pooling pass (LLM.embed/classify/score) that rank 0 sends to the other ranks in place of a generation step."""
    prompts: list[list[int]]
    causal: bool


# CUDA's errors for what a stream capture refuses (cudaErrorStreamCaptureUnsupported to ...WrongThread), which torch
# raises as AcceleratorErrors with that error_code.
CAPTURE_REFUSALS = range(900, 909)


class ModelRunner:
    def __init__(self, config: Config, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.block_size = config.kvcache_block_size
        with tp_scope(self.tp.rank, self.tp.size, self.tp.group):
            # Resolved in this process: a bare "cuda" is each tensor-parallel rank's own GPU.
            self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()  # a CPU-path tuning: on CUDA it would only hold on to freed host memory
        self.model: nn.Module | None = None
        # Encoders (BERT, RoBERTa): bidirectional with absolute positions, classified at their first token.
        self.encoder = is_encoder(config.hf_config.architectures)
        # Classifiers and encoders only pool (LLM.embed, classify, score).
        self.generates = not (self.encoder or is_classifier(config.hf_config.architectures))
        self.lora: LoRAModel | None = None  # the adapter slots, with enable_lora
        try:
            self._set_up(config)
        except BaseException as e:
            # The caller keeps the exception, whose traceback holds the frames below this one: without clearing
            # them, the model and whatever caches exist would stay allocated (on CUDA, on the device) as long.
            self.close()
            error = e
            while error is not None:  # and the errors it chains (raise ... from None keeps __context__)
                traceback.clear_frames(error.__traceback__)
                chained = error.__cause__ or error.__context__
                if error.__suppress_context__:
                    error.__context__ = None  # never shown: nothing lost, and its frames are freed whole
                error = chained
            raise

    def _set_up(self, config: Config) -> None:
        """Model, backend, persistent batch, caches (sized on CUDA by a warm-up), decode graphs, sampling state."""
        start = time.perf_counter()
        with tp_scope(self.tp.rank, self.tp.size, self.tp.group):
            self.model = self._load_model(config, self.device)
        self.tp.meet()  # before the first collective that waits only the step timeout (on CUDA, the warm-up's)
        self.upload = HostStaging(self.device)  # every small upload of a step, in one pinned ring
        if config.enable_lora:  # before the caches are sized (its slots take memory), and before the weights' repacking
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, self.upload)
        # Counted before the CPU path repacks the linear weights out of their parameters.
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for module in self.model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading(min(config.max_num_seqs, 256))
        # Before the caches: on CUDA the warm-up that sizes them runs the attention layers.
        self.backend = get_backend(config.attention_backend, config.torch_dtype, self.device)
        if self.tp.rank == 0:
            logger.info("Model %s: %.2f GiB of %s weights on %s%s, loaded in %.1f s; attention: %s",
                        type(self.model).__name__, weight_bytes / 2**30, str(config.torch_dtype).removeprefix("torch."),
                        self.device, f" per rank x {self.tp.size}" if self.tp.size > 1 else "",
                        time.perf_counter() - start, type(self.backend).__name__)
        for a in self._attention_layers():
            a.backend = self.backend
        self.graph_runner: CUDAGraphRunner | None = None
        self.sampler = Sampler()  # before the caches: the warm-up samples too
        self.logits_processors = (CustomLogitsProcessors(config.logits_processor_classes, config, self.device)
                                  if config.logits_processor_classes and self.tp.rank == 0 else None)  # rank 0 samples
        self.prompt_embedding = (prompt_embedding(self.model, config, self.generates) if config.enable_prompt_embeds
                                 else None)
        # The most rows a step samples (a row per sequence and draft), and the most rows of prompt logprobs whose
        # logits are held at once: a budget's worth in at most 16 pieces, each as large as a sampled batch at least.
        self.max_sampled_rows = config.max_num_seqs * (1 + (config.speculative.num_speculative_tokens
                                                             if config.speculative else 0))
        self.logit_chunk_rows = max(self.max_sampled_rows, -(-config.max_num_batched_tokens // 16))
        # Decode input ids are fed from the tokens sampled on the device by rank 0, which alone samples. With tensor
        # parallelism only async scheduling needs that (its host ids are placeholders): the other ranks then receive
        # the fed ids from rank 0 (Step.fed); otherwise the host's ids, which every rank has, stand.
        feed = self.tp.rank == 0 and (self.tp.size == 1 or config.async_scheduling)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.max_num_batched_tokens,
                                      self.block_size, self.device, feed_sampled_ids=feed,
                                      lora_slots=LoRASlots(config.max_loras, config.max_num_seqs)
                                      if config.enable_lora else None)
        self.num_state_slots, state_bytes = self._allocate_state_cache()
        self.num_kvcache_blocks = self._allocate_kv_cache(state_bytes)
        if self.device.type == "cuda" and config.attention_backend == "triton" and self.generates:
            self._compile_kernels()
        self.graph_runner = self._capture_graphs()
        self.seeds = random.Random(config.seed)  # the noise seeds of requests without one
        self.penalty_cache = PenaltyCache(self.upload)
        self.token_tables = TokenTables(config.max_num_seqs, self.upload)
        self.to_host = HostTransfer(self.device)
        # The step launched last: with async scheduling, the one in flight while the next is launched, whose tokens
        # that next step's bad words and grammars read (see _pending_tokens).
        self.last_launch: LaunchedStep | None = None

    @staticmethod
    def _load_model(config: Config, device: torch.device) -> nn.Module:
        """The model built where it runs, in its dtype (no host copy of the weights on CUDA), then filled from the
        checkpoint one tensor, or one tensor-parallel slice of it, at a time."""
        cls = get_model_class(config.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with device, shared_rope_tables():
                model = cls(config.hf_config)
        except ValueError as e:  # a setting the family refuses, named by its config: and where the config is
            raise ValueError(f"{e} (model: {config.gguf_path or config.model_path})") from None
        finally:
            torch.set_default_dtype(default_dtype)
        if config.gguf_path is not None:
            weights = iter_gguf_weights(config.gguf_path, config.hf_config)
        elif (scheme := quant_scheme(config.hf_config)) is not None:
            weights = dequantized_weights(iter_safetensors(config.model_path), safetensors_names(config.model_path),
                                          scheme, device, config.torch_dtype)
        else:
            weights = iter_safetensors(config.model_path)
        load_weights(model, weights, config.gguf_path)
        return model.eval()

    def close(self) -> None:
        """Give back the memory of the model, its caches and graphs (on CUDA, to the device): they are dropped
        here, so nothing waits for the engine itself to be garbage-collected."""
        if self.model is None:
            return
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.k_cache = module.v_cache = torch.empty(0)
                module.backend = None
            elif isinstance(module, RecurrentLayer):
                module.free_state()
        self.model = self.prompt_embedding = self.backend = self.graph_runner = None
        self.lora = self.logits_processors = None
        # Their device and pinned buffers.
        self.input_batch = self.penalty_cache = self.token_tables = self.upload = self.to_host = None
        self.last_launch = None
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per stream it ran on (the graphs' capture stream too) for the process's life;
            # the capture stream's is in use while another engine's graphs live (see cuda_graph.CAPTURED).
            if not cuda_graph.CAPTURED:
                getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _available_memory(self) -> int:
        """Host memory this rank's caches may take from on the CPU: its share of the host's (ranks on one host share
        it). Every rank gets the same cache: the tightest one decides."""
        return self.tp.all_min(available_host_memory() // self.tp.local_size)

    def _allocate_state_cache(self) -> tuple[int, int]:
        """Recurrent-state slots of the recurrent layers, one per running sequence (max_num_seqs, or fewer
        if they would take more than half the cache budget: on CUDA what gpu_memory_utilization leaves, on the CPU
        the cache budget), and their bytes; (0, 0) without such layers. One more, the last (slot -1), is spare: what
        a step writes there (a decode graph's padding rows, warm-up steps) nobody reads back."""
        layers = [m for m in self.model.modules() if isinstance(m, RecurrentLayer)]
        if not layers:
            return 0, 0
        slot_bytes = sum(a.slot_bytes(self.config.torch_dtype) for a in layers)
        if self.device.type == "cuda":
            free, total = settled_mem_info(self.device)
            budget = self.tp.all_min(state_bytes_for_gpu(total, free, self.config.gpu_memory_utilization))
        else:
            budget = min(KV_CACHE_MAX_BYTES, self._available_memory() * KV_CACHE_MEMORY_FRACTION) // 2
        num_slots = min(self.config.max_num_seqs, int(budget // slot_bytes) - 1)
        if num_slots < 1:
            raise ValueError(f"not enough memory for the recurrent state of one sequence ({slot_bytes} bytes)")
        for a in layers:
            a.allocate_state(num_slots + 1, self.config.torch_dtype, self.device)
        return num_slots, (num_slots + 1) * slot_bytes

    def _allocate_kv_cache(self, reserved_bytes: int = 0) -> int:
        """KV blocks of the attention layers: num_kvcache_blocks if given; one sequence's for a model that only pools
        (a classifier, an encoder: the scheduler's accounting, never written); else on
        CUDA what gpu_memory_utilization leaves after the weights and the warm-up's activations, on the CPU the cache
        budget minus reserved_bytes (the recurrent state)."""
        layers = self._attention_layers()
        itemsize = self.config.torch_dtype.itemsize
        block_bytes = sum(self.block_size * a.cache_values_per_token() * itemsize for a in layers)
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None and not self.generates:  # the pooling passes never touch the cache
            num_blocks = -(-self.config.max_model_len // self.block_size)
        if num_blocks is None and not layers:  # attention-free (Mamba): blocks only count tokens, in no memory
            num_blocks = -(-self.config.max_num_seqs * self.config.max_model_len // self.block_size)
        if self.device.type == "cuda":
            if num_blocks is None:
                num_blocks = self.tp.all_min(profile_kv_cache_blocks(
                    self._warm_up, self.device, self.config.gpu_memory_utilization, block_bytes))
            if num_blocks * self.block_size < self.config.max_model_len:
                raise ValueError(f"GPU memory left for the KV cache holds {num_blocks} blocks of {self.block_size} "
                                 f"tokens, less than max_model_len={self.config.max_model_len}; raise "
                                 f"gpu_memory_utilization or lower max_model_len")
        else:
            num_blocks = self._cpu_kv_cache_blocks(num_blocks, block_bytes, reserved_bytes)
        for a in layers:
            a.allocate_cache(num_blocks, self.block_size, self.config.torch_dtype, self.device)
        if self.tp.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens (%d tokens), %.2f GiB%s", num_blocks, self.block_size,
                        num_blocks * self.block_size, num_blocks * block_bytes / 2**30,
                        f" per rank x {self.tp.size}" if self.tp.size > 1 else "")
        return num_blocks

    def _cpu_kv_cache_blocks(self, num_blocks: int | None, block_bytes: int, reserved_bytes: int) -> int:
        available = self._available_memory()
        if num_blocks is not None:
            if num_blocks * block_bytes > available:
                raise ValueError(f"num_kvcache_blocks={num_blocks} needs {num_blocks * block_bytes / 2**30:.1f} GiB, "
                                 f"more than the {available / 2**30:.1f} GiB available")
            return num_blocks
        wanted = -(-self.config.max_num_seqs * self.config.max_model_len // self.block_size)
        budget = min(KV_CACHE_MAX_BYTES, available * KV_CACHE_MEMORY_FRACTION) - reserved_bytes
        affordable = int(budget) // block_bytes
        num_blocks = min(wanted, affordable)
        if num_blocks * self.block_size < self.config.max_model_len:
            raise ValueError(f"not enough memory for a KV cache holding max_model_len={self.config.max_model_len}"
                             f" tokens ({affordable} blocks affordable); lower max_model_len")
        return num_blocks

    def _warm_up(self) -> None:
        """The largest step the scheduler can make, before the cache exists (nothing is stored): its most tokens,
        longest sequence and most sequences (see warm_up_lengths), its first max_sampled_rows rows sampled with
        every filter (top-p's sort of the vocabulary makes several [rows, vocab] temporaries) and logprobs, as vLLM's
        profile run samples, and the others' prompt logprobs, a chunk of logits at a time as a step computes them
        (see logit_results)."""
        c = self.config
        hidden = self._dummy_step(warm_up_lengths(c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len),
                                  all_logits=True)
        num_sampled = min(len(hidden), self.max_sampled_rows)
        targets = torch.zeros(len(hidden) - num_sampled, dtype=torch.long, device=hidden.device)
        self.logit_results(hidden, num_sampled,
                           lambda logits: self.sampler(logits, filtering_metadata(num_sampled, logits.device)),
                           targets, 1)

    def _compile_kernels(self) -> None:
        """Triton compiles a kernel variant the first time a step needs it (about a second each, until its disk cache
        holds it): a small prefill step for each query-tile height of the Triton attention (prefill_tile_lengths),
        over no cached prefix and over one, decode steps of one sequence and of the most a step holds (split into
        segments and not, the extremes of TritonAttentionBackend.num_segments), and the sampler's race, compile them
        at start-up rather than while requests are served (LLM.embed's non-causal pass still compiles its own on
        first use)."""
        c = self.config
        layers = self._attention_layers()
        # MLA's latent cache: a chunk over a short prefix is attended decompressed, one head per KV head, and over a
        # long one absorbed into the latent cache, all heads on one; each takes tiles of its own.
        latent = any(a.value_prefix_dim for a in layers)
        groups = {a.num_heads // a.num_kv_heads for a in layers} | ({1} if latent else set())
        budget = min(c.max_num_batched_tokens, c.max_model_len - 1)  # - 1: room for a cached token
        lengths = sorted({n for g in groups for n in self.backend.kernels.prefill_tile_lengths(g) if n <= budget})
        steps = [(new, cached) for new in lengths
                 for cached in sorted({0, 1, c.max_model_len - new} if latent else {0, 1})]
        for num_seqs in {1, min(c.max_num_seqs, c.max_num_batched_tokens)}:
            self._dummy_step([1] * num_seqs, cached=1)
        hidden = None
        for new, cached in steps:  # the last one's logits are those the race kernel compiles for
            hidden = self._dummy_step([new], cached, all_logits=(new, cached) == steps[-1])
        if hidden is not None:
            self.logit_results(hidden, len(hidden), compile_race)  # on rank 0, which alone samples

    def _dummy_step(self, lengths: list[int], cached: int = 0, all_logits: bool = False) -> torch.Tensor:
        """A step of prompts of `lengths` new tokens, each after `cached` tokens taken as stored, every block of them
        block 0 (no sequence's yet: what the step reads and writes there matters to none); the final hidden states
        of every row with all_logits, else of none. Every rank runs it alike (nothing to broadcast)."""
        seqs = [Sequence([0] * (cached + n), SamplingParams(temperature=0), self.block_size) for n in lengths]
        for seq in seqs:
            seq.num_computed_tokens = cached
            seq.block_table = [0] * seq.num_blocks
        batch = ScheduledBatch(seqs, lengths)
        input_ids, positions, meta, _ = self.prepare(batch, batch.samples)
        # A one-token budget makes a step of one 1-token prompt, which backends take for a decode over the cache
        # that may not exist yet; attending non-causally over this step's one key is the same attention.
        if meta.is_decode and not cached:
            meta.causal = False
        # With LoRA every token goes through an adapter: the LoRA products' temporaries count too.
        hidden = self.execute(Step(input_ids, positions, meta, list(range(sum(lengths))) if all_logits else [], 0,
                                   None if self.lora is None else self.lora.warm_up_mapping(sum(lengths))))
        self.input_batch.remove([seq.seq_id for seq in seqs])
        return hidden

    def model_capturable(self) -> bool:
        """Whether this model's decode forward can be captured in a graph: not for classifiers, which never decode,
        nor for mixture-of-experts models but in bf16 on sm90 (see experts_capturable: elsewhere torch._grouped_mm
        loops over offsets copied to the host), nor with layers marked `per_step_host_state` (sparse attention's
        spans and selections, relative logits' spans, read from each step's lengths on the host). Recurrent state
        (see RecurrentBatch.from_metadata) and LoRA (see LoRALayer.add_every_slot) are captured."""
        experts = experts_capturable(self.config.torch_dtype, self.device)
        return (self.generates
                and not any(isinstance(m, FusedMoE) and not experts or getattr(m, "per_step_host_state", False)
                            for m in self.model.modules()))

    def _capture_graphs(self) -> CUDAGraphRunner | None:
        """Decode graphs on CUDA for the flash and triton backends (whose decode reads only fixed-address tensors)
        unless enforce_eager, for a model_capturable model: on every tensor-parallel rank or on none (ranks on GPUs
        of different capabilities may judge a mixture-of-experts model differently), as a replayed step's
        collectives must match the eager step's of the other ranks."""
        if (self.config.enforce_eager or self.device.type != "cuda" or self.config.attention_backend == "cpu"
                or not self.tp.all_min(int(self.model_capturable()))):
            return None
        start = time.perf_counter()
        runner = self.new_graph_runner()
        try:
            runner.capture()
        except RuntimeError as e:  # an op the capture refused (one that waits for the device): eager decode is slower
            if getattr(e, "error_code", None) not in (None, *CAPTURE_REFUSALS):
                raise  # a fault (an illegal address, say) ends the process's CUDA context: nothing would run eagerly
            failure = str(e)
        else:
            if self.tp.rank == 0:
                logger.info("CUDA graphs: decode at %d batch sizes (1 to %d) captured in %.1f s", len(runner.sizes),
                            runner.sizes[-1], time.perf_counter() - start)
            return runner
        del runner  # its graphs and their memory pool (out of the except block, whose traceback held them)
        torch.cuda.empty_cache()
        logger.warning("CUDA graphs: capture failed, decode runs eagerly: %s", failure)
        return None

    def new_graph_runner(self, new_graph: Callable[[], CUDAGraph] | None = None) -> CUDAGraphRunner:
        """Decode graphs of this runner's model, not yet captured (new_graph: a stand-in for torch's, in tests)."""
        c = self.config
        return CUDAGraphRunner(self.model, self.backend, c.max_num_seqs, c.max_model_len, self.block_size,
                               hidden_states_width(c.hf_config), c.torch_dtype, self.device,
                               recurrent=bool(self.num_state_slots),
                               lora_step=None if self.lora is None else self.lora.step, new_graph=new_graph)

    def prepare(self, batch: ScheduledBatch, samples: list[bool]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input_ids, positions, attention metadata (host tensors, valid until the next step), and the rows whose
        logits are sampled."""
        input_ids, positions, meta, sample_rows = self.input_batch.prepare(batch, samples)
        if self.num_state_slots:
            meta.state_slots = self.input_batch.state_slots([s.state_slot for s in batch.seqs])
        return input_ids, positions, meta, sample_rows

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """The next token of every sequence whose scheduled tokens reach its end (None for partial prompt
        chunks), with logprobs where asked for."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue a step on the device: its forward pass, sampling (the tokens kept in their InputBatch rows for the
        next step to feed) and the copy of its results to the host, which collect() waits for. Nothing here waits
        for the device, so the next step can be scheduled while this one runs; but a step launched ahead of
        sequences whose sampling reads their generated tokens (bad words of several tokens, structured outputs)
        waits, once its forward pass is queued, for the tokens of the step in flight (see _pending_tokens)."""
        samples = batch.samples
        input_ids, positions, meta, sample_rows = self.prepare(batch, samples)
        prompt_rows = self._prompt_logit_rows(batch, meta.cu_seqlens_q.tolist())
        step = Step(input_ids, positions, meta, sample_rows + [row for row, _, _ in prompt_rows], len(sample_rows),
                    None if self.lora is None else self.input_batch.lora_mapping,
                    fed=self.tp.size > 1 and self.input_batch.num_fed > 0,
                    prompt_embeds=self.input_batch.prompt_embeds)
        # The other ranks execute the same step (serve).
        hidden = self.execute(self.tp.broadcast(step))
        launched = LaunchedStep(batch, [i for i, s in enumerate(samples) if s], prompt_rows)
        if not step.logit_rows:
            return launched
        # Everything is computed where the logits are; only ids and logprobs come back, in one transfer.
        drafts = batch.draft_token_ids
        seqs = [batch.seqs[i] for i in launched.sampled for _ in range(1 + len(drafts.get(i, ())))] if drafts \
            else [batch.seqs[i] for i in launched.sampled]
        targets, k = self._prompt_targets(batch, prompt_rows) if prompt_rows else (None, 0)
        result, prompt = self.logit_results(hidden, step.num_sampled, lambda logits: self.sample(seqs, logits),
                                            targets, k)
        verified = self._verify(batch, launched.sampled, result.token_ids) if drafts else None
        if result is not None and not drafts:
            self.input_batch.record_sampled(result.token_ids)
        sampled_parts = [] if result is None else [result.token_ids, *(result.logprobs or ())]
        launched.num_sampled_parts = len(sampled_parts)
        if drafts:
            launched.verified = verified[1:]
        launched.results = self.to_host.start(sampled_parts + list(prompt) + ([verified[0]] if drafts else []))
        self.last_launch = launched
        return launched

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """The RunnerOutput of a launched step, once its results have reached the host (see run)."""
        batch, sampled, n = launched.batch, launched.sampled, launched.num_sampled_parts
        out = RunnerOutput([None] * len(batch.seqs))
        if launched.results is None:
            return out
        host = launched.results.wait()
        if launched.prompt_rows:
            prompt_end = len(host) - (launched.verified is not None)  # the accepted-draft counts come last
            out.prompt_logprobs = _prompt_logprob_lists(batch, launched.prompt_rows, host[n:prompt_end])
        if not n:
            return out
        tokens = host[0].tolist()
        rows = None if n == 1 else _logprob_rows(tokens, host[1:n])
        if batch.draft_token_ids:
            self._emit_verified(batch, sampled, launched.verified, host[-1].tolist(), tokens, rows, out)
            return out
        for i, token in zip(sampled, tokens):
            out.token_ids[i] = token
        if rows is not None:
            out.logprobs = [None] * len(batch.seqs)
            for i, row in zip(sampled, rows):
                if batch.seqs[i].params.logprobs is not None:  # rows are computed for the whole batch
                    out.logprobs[i] = row
        return out

    def _verify(self, batch: ScheduledBatch, sampled: list[int], token_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """A step with drafts, on the device: how many drafts each sampled sequence accepted (see verify_drafts) and
        the last token it emits (the one sampled after them); and each sequence's first row among token_ids."""
        drafts = batch.draft_token_ids
        counts = np.array([1 + len(drafts.get(i, ())) for i in sampled], dtype=np.int64)
        first = np.cumsum(counts) - counts
        draft_ids = np.full(int(counts.sum()), -1, dtype=np.int64)
        for j, i in enumerate(sampled):
            if i in drafts:
                draft_ids[first[j]:first[j] + len(drafts[i])] = drafts[i]
        seq_index = np.repeat(np.arange(len(sampled)), counts)
        draft_ids, seq_index, offsets, first_rows = self.upload(
            draft_ids, seq_index, np.arange(len(draft_ids)) - first[seq_index], first)
        num_accepted = verify_drafts(token_ids, draft_ids, seq_index, offsets, len(sampled))
        return num_accepted, token_ids[first_rows + num_accepted], first

    def _emit_verified(self, batch: ScheduledBatch, sampled: list[int], verified: tuple[torch.Tensor, np.ndarray],
                       num_accepted: list[int], tokens: list[int], logprob_rows: list[TokenLogprobs] | None,
                       out: RunnerOutput) -> None:
        """Each sampled sequence's emitted tokens into out (the first in token_ids, the accepted run after it in
        extra_token_ids), with their logprobs; the last one of each is kept in its InputBatch row."""
        last_tokens, first = verified
        out.extra_token_ids = [[] for _ in batch.seqs]
        if logprob_rows is not None:
            out.logprobs, out.extra_logprobs = [None] * len(batch.seqs), [[] for _ in batch.seqs]
        for i, start, accepted in zip(sampled, first.tolist(), num_accepted):
            out.token_ids[i] = tokens[start]
            out.extra_token_ids[i] = tokens[start + 1:start + accepted + 1]
            if logprob_rows is not None and batch.seqs[i].params.logprobs is not None:
                out.logprobs[i] = logprob_rows[start]
                out.extra_logprobs[i] = logprob_rows[start + 1:start + accepted + 1]
        self.input_batch.record_verified(last_tokens, self.input_batch.sampled_positions[first] + num_accepted)

    @torch.inference_mode()
    def execute(self, step: Step) -> torch.Tensor:
        """One forward pass of prepare()'s CPU tensors on this rank's device, its tokens run with the adapters
        step.lora_mapping gives them; the final hidden states of step.logit_rows."""
        rows = self.input_batch.logit_index(step.logit_rows)
        input_ids, positions, meta = step.input_ids, step.positions, step.meta
        # A graph's embedding takes no prompt embeddings (a one-token prompt of them makes a decode-shaped step).
        size = (self.graph_runner.padded_size(meta.num_seqs)
                if self.graph_runner and meta.is_decode and step.prompt_embeds is None else None)
        if self.lora is not None:
            self.lora.set_step(step.lora_mapping, groups=size is None)
        if size is not None:
            input_ids = self.graph_runner.load(self.input_batch.decode_inputs(input_ids, positions, meta, size,
                                                                               step.lora_mapping)).input_ids
        else:
            input_ids, positions, meta = self.input_batch.to_device(input_ids, positions, meta)
        self.input_batch.feed_sampled(input_ids)
        # After the last upload, before the forward pass: the next step's prepare() waits for the uploads alone.
        self.input_batch.record_uploads()
        if step.fed:
            self.tp.share(input_ids)
        if size is not None:
            hidden = self.graph_runner.replay(size, meta.num_seqs)
        else:
            self.backend.prepare(meta)
            with self._prompt_embeds(step.prompt_embeds):
                hidden = self.model(input_ids, positions, meta)
        return hidden[rows]

    @contextmanager
    def _prompt_embeds(self, embeds: tuple[torch.Tensor, torch.Tensor] | None) -> Iterator[None]:
        """The step's prompt embeddings in place of those rows of the token embedding's output, for one forward (a
        hook on the module, so that a family's own embedding module (Inkling's normed one) is replaced whole)."""
        if embeds is None:
            yield
            return
        # From pageable memory, non_blocking only stages the copy: a blocking one would wait for all queued work.
        index, values = (t.to(self.device, non_blocking=True) for t in embeds)
        handle = self.prompt_embedding.register_forward_hook(
            lambda module, args, out: out.index_copy(0, index, values.to(out.dtype)))
        try:
            yield
        finally:
            handle.remove()

    @torch.inference_mode()
    def logit_results(self, hidden: torch.Tensor, num_sampled: int,
                      sample: Callable[[torch.Tensor], T] | None = None, targets: torch.Tensor | None = None,
                      k: int = 0) -> tuple[T | None, tuple[torch.Tensor, ...]]:
        """What rank 0 takes from the logits of hidden's rows: `sample` of the first num_sampled rows' logits, and
        the top_logprobs of the other rows at `targets` (prompt logprobs), logit_chunk_rows rows at a time, so that a
        step never holds all its rows' logits at once (a prefill's 8,192 rows at Qwen3's vocabulary are 5 GB in
        fp32; the KV sizing's warm-up measures a chunk). The LM head gathers every rank's shard of the vocabulary on
        rank 0: the other ranks make the same calls, and get (None, ())."""
        result = self._on_logits(hidden[:num_sampled], sample) if num_sampled else None
        parts, prompt = [], hidden[num_sampled:]
        for start in range(0, len(prompt), self.logit_chunk_rows):
            rows = slice(start, start + self.logit_chunk_rows)
            parts.append(self._on_logits(prompt[rows], lambda logits: top_logprobs(logits, targets[rows], k)))
        return result, (tuple(torch.cat(p) for p in zip(*parts)) if parts and parts[0] is not None else ())

    def _on_logits(self, hidden: torch.Tensor, fn: Callable[[torch.Tensor], T]) -> T | None:
        """fn of the rows' logits on rank 0, None on the other ranks; the logits are freed when it returns."""
        logits = self.model.compute_logits(hidden)
        return None if logits is None else fn(logits)

    def serve(self) -> None:
        """Ranks > 0: execute rank 0's steps, and run its pooling passes, until it sends None."""
        while (step := self.tp.broadcast()) is not None:
            if isinstance(step, EncodeStep):
                self._encode(step.prompts, step.causal)
            else:
                self.logit_results(self.execute(step), step.num_sampled)

    @torch.inference_mode()
    def encode(self, prompts: list[list[int]], causal: bool, pooling: str) -> torch.Tensor:
        """Each prompt's final hidden states (see _encode) pooled: [prompts, hidden] fp32 (see pooling.pool)."""
        return pool(self._encode_on_every_rank(prompts, causal), [len(p) for p in prompts], pooling).cpu()

    @torch.inference_mode()
    def classify(self, prompts: list[list[int]]) -> torch.Tensor:
        """The classification head's logits [prompts, num_labels] on each prompt's hidden states pooled as the model
        says (its classifier_pooling): at its last token after a causal pass, or, for an encoder, after a
        bidirectional one, at its first token ([CLS]) or their mean (ModernBERT's choice). The head is replicated:
        rank 0 applies it alone."""
        hidden = self._encode_on_every_rank(prompts, causal=not self.encoder)
        pooled = pool(hidden, [len(p) for p in prompts], self.model.classifier_pooling)
        return self.model.compute_logits(pooled.to(hidden.dtype)).float().cpu()

    def _encode_on_every_rank(self, prompts: list[list[int]], causal: bool) -> torch.Tensor:
        """_encode on rank 0, with the other ranks running the same pass (serve): every rank ends with the whole
        hidden states (the row-parallel layers all-reduce them), rank 0's are returned."""
        self.tp.broadcast(EncodeStep(prompts, causal))
        return self._encode(prompts, causal)

    @torch.inference_mode()
    def _encode(self, prompts: list[list[int]], causal: bool) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the prompts, packed, without touching the KV cache: causal with
        position encoding (the model as it generates), or bidirectional without (the decoder used as an encoder);
        an encoder's, bidirectional with its absolute positions."""
        lens = [len(p) for p in prompts]
        cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device) if causal or self.encoder else None
        meta = AttentionMetadata(
            slot_mapping=None, block_tables=torch.empty(len(prompts), 0, dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=max(lens), max_seqlen_k=max(lens), block_size=self.block_size, causal=causal).to(self.device)
        # One-token prompts only: backends would take the step for a decode over the cache; attending
        # non-causally over a prompt's one key is the same attention.
        meta.causal = causal and meta.max_seqlen_q > 1
        self.backend.prepare(meta)
        if self.lora is not None:
            self.lora.set_step(None)  # the base model
        return self.model(torch.tensor([t for p in prompts for t in p], device=self.device), positions, meta)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        m = self._sampling_metadata(seqs, logits.shape[-1])
        out = self.sampler(logits, m)
        if m.penalties is not None:
            self.penalty_cache.count_sampled(out.token_ids[m.penalties.rows])
        return out

    def _sampling_metadata(self, seqs: list[Sequence], vocab: int) -> SamplingMetadata:
        """The metadata of this step's sampled sequences (seqs, in the order of prepare's sample_rows), gathered
        from their InputBatch rows with numpy and uploaded in one copy; each feature costs nothing unless a row
        uses it. Only ban lists, first seeds and penalty counts look at the sequences themselves."""
        batch = self.input_batch
        rows, positions, s = batch.sampled_rows, batch.sampled_positions, batch.sampling
        assert len(rows) == len(seqs), "seqs are not the sequences prepare() sampled"
        flags = s.flags[rows]
        some, every = int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags))
        host = {"temperatures": s.temperature[rows]}
        if not every & GREEDY:
            self._draw_seeds(seqs, rows)
            host["noise_keys"] = noise_keys(s.seed[rows], positions)
        max_top_k = None
        if some & TOP_K and (enabled := (k := s.top_k[rows])[(k > 0) & (k < vocab)]).size:
            host["top_k"], max_top_k = k, int(enabled.max())
        if some & TOP_P:
            host["top_p"] = p = s.top_p[rows]
            if max_top_k is not None and ((p < 1) & ((k <= 0) | (k >= vocab))).any():
                max_top_k = None  # a row with top-p but no top-k: its cut needs the whole vocabulary ranked
        if some & MIN_P:
            host["min_p"] = s.min_p[rows]
        pending = self._pending_tokens(seqs, positions) if some & (BAD_WORDS | STRUCTURED) else None
        if some & (MIN_TOKENS | BAD_WORDS):
            banned = self._banned(seqs, flags, positions < s.min_len[rows], pending)
            if banned is not None:
                host["banned"] = banned
        if some & PENALIZED:
            host["penalty_rows"] = np.flatnonzero(flags & PENALIZED)
            host["penalties"] = s.penalties[rows[host["penalty_rows"]]]
        if some & (ALLOWED_TOKENS | LOGIT_BIAS):
            self.token_tables.write(s.new_token_rows, vocab)
            for bit, name in ((ALLOWED_TOKENS, "allowed"), (LOGIT_BIAS, "bias")):
                if some & bit:
                    host[f"{name}_rows"] = np.flatnonzero(flags & bit)  # their batch rows, then InputBatch rows
                    host[f"{name}_table_rows"] = rows[host[f"{name}_rows"]]
        if some & STRUCTURED:
            host["grammar_rows"] = np.flatnonzero(flags & STRUCTURED)
            grammar_rows = host["grammar_rows"].tolist()
            host["grammar_bitmask"] = grammar_bitmask([seqs[i] for i in grammar_rows], vocab,
                                                      [pending[i] for i in grammar_rows])
        device = dict(zip(host, self.upload(*host.values())))
        m = SamplingMetadata(temperatures=device["temperatures"], top_k=device.get("top_k"),
                             top_p=device.get("top_p"), all_greedy=bool(every & GREEDY),
                             all_random=not some & GREEDY, noise_keys=device.get("noise_keys"),
                             min_p=device.get("min_p"), max_top_k=max_top_k)
        if some & LOGPROBS:
            m.num_logprobs, m.logprobs_mode = int(s.num_logprobs[rows].max()), self.config.logprobs_mode
        if "banned" in device:
            m.banned = tuple(device["banned"])
        if some & PENALIZED:
            m.penalties = self._penalties([seqs[i] for i in host["penalty_rows"].tolist()], device, vocab)
        if some & ALLOWED_TOKENS:
            m.disallowed = device["allowed_rows"], self.token_tables.disallowed[device["allowed_table_rows"]]
        if some & LOGIT_BIAS:
            t, tables = device["bias_table_rows"], self.token_tables
            m.logit_bias = device["bias_rows"], tables.bias_ids[t], tables.bias_values[t]
        if some & STRUCTURED:
            m.grammar_bitmask = device["grammar_rows"], device["grammar_bitmask"]
        if self.logits_processors is not None:
            self.logits_processors.update(seqs)
            m.logits_processors = self.logits_processors.argmax_changing
            m.argmax_invariant_processors = self.logits_processors.argmax_invariant
        return m

    def _draw_seeds(self, seqs: list[Sequence], rows: np.ndarray) -> None:
        """Seeds for the rows' sequences that have none, drawn from the engine's seed the first time a sequence is
        sampled, in batch order (the noise key is its seed and the position of the token being sampled)."""
        s = self.input_batch.sampling
        for i in np.flatnonzero(~s.has_seed[rows]).tolist():
            seqs[i].seed = self.seeds.getrandbits(64)
            s.set_seed(rows[i], seqs[i].seed)

    def _pending_tokens(self, seqs: list[Sequence], positions: np.ndarray) -> list[tuple[int, ...]]:
        """Per sampled row, the tokens before the one it samples that the host does not have yet, for the rows whose
        sampling reads them (Sequence.reads_history: they get no drafts, so that is at most one): the token that the
        step in flight samples for the sequence, when this step was scheduled ahead of it (async scheduling). They
        are read from that step's results, which this waits for: this step's forward pass is queued by now, so the
        device is not left idle."""
        gaps = [p - len(seq.token_ids) if seq.reads_history else 0 for seq, p in zip(seqs, positions.tolist())]
        if not any(gaps):
            return [()] * len(seqs)
        step = self.last_launch
        sampled = dict(zip((step.batch.seqs[i].seq_id for i in step.sampled), step.results.wait()[0].tolist()))
        return [(sampled[seq.seq_id],) if gap else () for seq, gap in zip(seqs, gaps)]

    @staticmethod
    def _banned(seqs: list[Sequence], flags: np.ndarray, short: np.ndarray,
                pending: list[tuple[int, ...]] | None) -> np.ndarray | None:
        """[2, N] (row, token id) pairs the rows may not sample: the EOS and stop tokens of rows short of their
        min_tokens, and the bad words each row's generated tokens (and its pending ones, see _pending_tokens) would
        complete; None if there are none."""
        pairs = [(i, t) for i in np.flatnonzero((flags & MIN_TOKENS).astype(bool) & short).tolist()
                 for t in (*seqs[i].eos_token_ids, *seqs[i].params.stop_token_ids)]
        pairs += [(i, t) for i in np.flatnonzero(flags & BAD_WORDS).tolist()
                  for t in bad_word_bans(seqs[i], pending[i])]
        return np.array(pairs, dtype=np.int64).T if pairs else None

    def _penalties(self, seqs: list[Sequence], device: dict[str, torch.Tensor], vocab: int) -> Penalties:
        """The penalized rows' parameters (uploaded), and their prompt masks and output counts from the device-side
        cache."""
        prompt_mask, output_counts = self.penalty_cache.gather(seqs, vocab)
        values = device["penalties"]
        return Penalties(rows=device["penalty_rows"], repetition=values[:, 0], presence=values[:, 1],
                         frequency=values[:, 2], prompt_mask=prompt_mask, output_counts=output_counts)

    @staticmethod
    def _prompt_logit_rows(batch: ScheduledBatch, cu_q: list[int]) -> list[tuple[int, int, int]]:
        """(hidden row, prompt token it predicts, sequence index) of each row this step owes prompt logprobs."""
        rows = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.needs_prompt_logits:
                start = batch.starts[i]
                rows += [(cu_q[i] + pos - start, seq.token_ids[pos + 1], i)
                         for pos in range(start, min(start + n, seq.num_prompt_tokens - 1))]
        return rows

    def _prompt_targets(self, batch: ScheduledBatch, rows: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
        """The prompt tokens this step's rows predict, on the device, and the most top logprobs their sequences ask
        for."""
        _, targets, owners = zip(*rows)
        k = max(batch.seqs[i].params.prompt_logprobs for i in set(owners))
        return self.upload(np.array(targets, dtype=np.int64))[0], k


def _prompt_logprob_lists(batch: ScheduledBatch, rows: list[tuple[int, int, int]], result: list[torch.Tensor]
                          ) -> list[list[TokenLogprobs] | None]:
    """Per sequence owing prompt logprobs: those of the prompt tokens that this step's rows predict."""
    _, targets, owners = zip(*rows)
    out: list[list[TokenLogprobs] | None] = [None] * len(batch.seqs)
    for i, row in zip(owners, _logprob_rows(list(targets), result)):
        out[i] = (out[i] or []) + [row]
    return out


def _logprob_rows(token_ids: list[int], result: list[torch.Tensor]) -> list[TokenLogprobs]:
    chosen, ranks, top_ids, top_lps = (t.tolist() for t in result)
    top_ranks = list(range(1, result[2].shape[-1] + 1))
    return [([tok] + ids, [lp] + lps, [rank] + top_ranks)
            for tok, lp, rank, ids, lps in zip(token_ids, chosen, ranks, top_ids, top_lps)]


def prompt_embedding(model: nn.Module, config: Config, generates: bool) -> VocabParallelEmbedding:
    """The token embedding whose output prompt embeddings stand in for (enable_prompt_embeds): the model's one
    vocabulary embedding, whose output is what transformers' get_input_embeddings() gives; a ValueError naming the
    architecture for a model that does not generate, whose token ids go to another embedding too, or whose class
    says why not (`prompt_embeds_refused`)."""
    architecture = config.hf_config.architectures[0]
    embeddings = [m for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    reason = ("it does not generate" if not generates else getattr(model, "prompt_embeds_refused", None)
              or (None if len(embeddings) == 1 else "its token ids go to more than one embedding"))
    if reason is not None:
        raise ValueError(f"enable_prompt_embeds: {architecture} ({config.model_path}) takes no prompt embeddings: "
                         f"{reason}")
    return embeddings[0]


def warm_up_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the step that needs the most activation memory: as many tokens as the budget allows, as
    many sequences (sampled rows) as allowed, the first as long as the others leave room for (attention's largest
    temporaries); at least 2 tokens in the first whenever the budget allows, so that the step is a prefill."""
    num_seqs = min(max_num_seqs, max(1, max_num_batched_tokens - 1))
    total = min(max_num_batched_tokens, num_seqs * max_model_len)
    first = min(max_model_len, total - (num_seqs - 1))
    if num_seqs == 1:
        return [first]
    per_seq, extra = divmod(total - first, num_seqs - 1)
    return [first] + [per_seq + 1] * extra + [per_seq] * (num_seqs - 1 - extra)


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
