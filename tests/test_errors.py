"""Bad inputs raise clear errors (naming the argument, the value, and the file where there is one) and leave the
engine usable, at every entry point; bad model directories fail at construction; a load test with a tiny KV cache
(preemption, recompute) matches a roomy-cache run."""
from __future__ import annotations

import gc
import json
import random
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import assert_greedy_match, hf_greedy
from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.model_runner import ModelRunner

MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE_PROMPTS = ["The quick brown fox", [5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(100, 120))]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, kvcache_block_size=8)


@pytest.fixture(scope="module")
def baseline(llm):
    outs = llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    engine = llm.llm_engine
    assert engine.scheduler.is_finished(), "requests were left queued"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == engine.model_runner.num_kvcache_blocks, "KV blocks were leaked"
    assert all(b.ref_count == 0 for b in bm.blocks.values())


def assert_usable(llm, baseline):
    assert_idle(llm)
    outs = llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Bad requests
# ----------------------------------------------------------------------------------------------------------

GOOD = [1, 2, 3]
BAD_REQUESTS = {
    "empty-string": ("", None, ValueError, "empty"),
    "empty-string-in-list": ([GOOD, ""], None, ValueError, "empty"),
    "no-prompts": ([], None, ValueError, "no prompts"),
    "empty-token-list": ([[]], None, ValueError, "empty"),
    "too-long-with-max-tokens": ([[7] * 100], SamplingParams(max_tokens=29), ValueError, "max_model_len"),
    "prompt-alone-too-long": ([[7] * 200], SamplingParams(max_tokens=1), ValueError, "max_model_len"),
    "negative-token-id": ([[5, -1, 6]], None, ValueError, "token id -1"),
    "token-id-equal-vocab": ([[5, 512]], None, ValueError, "token id 512"),
    "token-id-huge": ([[10**12]], None, ValueError, "vocabulary"),
    "float-token-id": ([[1, 2.0]], None, TypeError, "int"),
    "str-token-id": ([[1, "2"]], None, TypeError, "int"),
    "bool-token-id": ([[True, 2]], None, TypeError, "int"),
    "none-token-id": ([[1, None]], None, TypeError, "token ids must be ints, got None"),
    "none-in-a-flat-token-list": ([1, None], None, TypeError, "token ids must be ints, got None"),
    "none-in-prompt-token-ids": ({"prompt_token_ids": [1, None]}, None, TypeError, "got None"),
    "text-as-prompt-token-ids": ({"prompt_token_ids": "text"}, None, TypeError, "'prompt_token_ids'.*got str"),
    "bytes-prompt": (b"abc", None, TypeError, "got bytes"),
    "bytes-in-a-prompt-list": ([GOOD, b"abc"], None, TypeError, "got bytes"),
    "bytearray-as-prompt-token-ids": ({"prompt_token_ids": bytearray(b"ab")}, None, TypeError, "got bytearray"),
    "prompt-of-wrong-type": (5, None, TypeError, "prompt"),
    "prompt-list-item-of-wrong-type": ([GOOD, 3.5], None, TypeError, "prompt"),
    "tensor-prompt": (torch.tensor([1, 2]), None, TypeError, "prompt"),
    "too-many-params": ([GOOD, GOOD], [GREEDY] * 3, ValueError, "3 sampling params for 2 prompts"),
    "too-few-params": ([GOOD, GOOD, GOOD], [GREEDY], ValueError, "1 sampling params for 3 prompts"),
    "params-item-wrong-type": ([GOOD, GOOD], [GREEDY, "greedy"], TypeError, "SamplingParams"),
    "params-item-none": ([GOOD], [None], TypeError, "SamplingParams"),
    "params-dict": ([GOOD], {"temperature": 0.0}, TypeError, "SamplingParams"),
    "params-float": ([GOOD], 0.5, TypeError, "SamplingParams"),
    "params-str": ([GOOD], "greedy", TypeError, "SamplingParams"),
    "one-bad-prompt-in-batch": ([GOOD, [4, 5, 6, 7], [1, 99999], GOOD], GREEDY, ValueError, "99999"),
    "one-bad-params-in-batch": ([GOOD, GOOD, GOOD], [GREEDY, GREEDY, 1], TypeError, "SamplingParams"),
    # Token ids that only the model's vocabulary (512 ids) can check.
    "logit-bias-id-equal-vocab": ([GOOD], SamplingParams(logit_bias={3: 1.0, 512: 2.0}), ValueError,
                                  r"logit_bias token id 512 is outside the vocabulary \[0, 512\)"),
    "allowed-id-huge": ([GOOD], SamplingParams(allowed_token_ids=[3, 10**9]), ValueError,
                        "allowed_token_ids token id 1000000000 is outside the vocabulary"),
    "allowed-ids-all-withheld": ([GOOD], SamplingParams(allowed_token_ids=[5, 6], stop_token_ids=[6, 5], min_tokens=2),
                                 ValueError, r"allowed_token_ids=\[5, 6\] leave nothing to sample.*min_tokens=2"),
    "truncate-beyond-max-model-len": ([GOOD], SamplingParams(truncate_prompt_tokens=MAX_LEN + 1), ValueError,
                                      f"truncate_prompt_tokens={MAX_LEN + 1} exceeds max_model_len={MAX_LEN}"),
    "truncated-prompt-still-too-long": ([[7] * 200], SamplingParams(truncate_prompt_tokens=-1), ValueError,
                                        "prompt of 128 tokens.*max_model_len=128"),
}


@pytest.mark.parametrize("prompts, params, exc, match", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_raises_and_engine_stays_usable(llm, baseline, prompts, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_usable(llm, baseline)


def _stream(llm, prompts, params):
    return list(llm.generate_iter(prompts, params))


def _add_request(llm, prompts, params):
    llm.llm_engine.add_request("mutated", prompts, params)


# SamplingParams fields set after construction: each entry point checks them again, with the same function.
MUTATED_PARAMS = {
    "temperature-nan": ("temperature", float("nan"), ValueError),
    "max_tokens-0": ("max_tokens", 0, ValueError),
    "top_p-0": ("top_p", 0, ValueError),
    "top_k-minus-2": ("top_k", -2, ValueError),
    "n-0": ("n", 0, ValueError),
    "stop-int": ("stop", 5, TypeError),
    "repetition_penalty-negative": ("repetition_penalty", -1, ValueError),
    "stop_token_ids-str": ("stop_token_ids", "7", TypeError),
    "seed-float": ("seed", 1.5, TypeError),
    "logit_bias-list": ("logit_bias", [1.0], TypeError),
    "logit_bias-inf": ("logit_bias", {3: float("-inf")}, ValueError),
    "allowed_token_ids-empty": ("allowed_token_ids", [], ValueError),
    "bad_words-str": ("bad_words", "word", TypeError),
    "truncate_prompt_tokens-0": ("truncate_prompt_tokens", 0, ValueError),
}


@pytest.mark.parametrize("entry", [LLM.generate, _stream, _add_request], ids=["generate", "generate_iter",
                                                                             "add_request"])
@pytest.mark.parametrize("field, value, exc", MUTATED_PARAMS.values(), ids=MUTATED_PARAMS.keys())
def test_sampling_params_changed_after_construction_are_checked_at_every_entry(llm, baseline, entry, field, value,
                                                                                exc):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(exc, match=field):
        entry(llm, [GOOD], params)
    assert_usable(llm, baseline)


def test_stop_token_ids_set_to_none_after_construction_means_none(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params.stop_token_ids = None  # as SamplingParams(stop_token_ids=None): no stop tokens
    llm.llm_engine.add_request("none-stop", GOOD, params)
    while llm.llm_engine.has_unfinished_requests():
        outs = llm.llm_engine.step()
    assert len(outs[0].outputs[0].token_ids) == 4
    assert_idle(llm)


@pytest.mark.parametrize("request_ids, match", [(None, "got None"), (5, "got 5"), (["a", None], "got None")])
def test_abort_request_refuses_what_is_not_request_ids(llm, baseline, request_ids, match):
    with pytest.raises(TypeError, match=match):
        llm.llm_engine.abort_request(request_ids)
    assert_usable(llm, baseline)


@pytest.mark.parametrize("prompts, exc, match", [
    (b"abc", TypeError, "got bytes"),
    ([1, None], TypeError, "got None"),
    ({"prompt_token_ids": "text"}, TypeError, "got str"),
])
def test_bad_embed_prompts(llm, baseline, prompts, exc, match):
    with pytest.raises(exc, match=match):
        llm.embed(prompts)
    assert_usable(llm, baseline)


@pytest.mark.parametrize("messages, kwargs, exc, match", [
    ([{"role": "user"}], {}, ValueError, "message 0 has no 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], {}, ValueError, "message 1 has no 'content'"),
    ([{"content": "hi"}], {}, ValueError, "message 0 has no 'role'"),
    ([{"role": "user", "content": 5}], {}, TypeError, "'content' must be a string or a list of text parts, got 5"),
    ([{"role": "user", "content": None}], {}, TypeError, "'content' must be a string or a list of text parts"),
    ([{"role": "user", "content": ["hi"]}], {}, ValueError, "a content part must be .* got 'hi'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, ValueError,
     "this model reads text only"),
    ([{"role": "assistant", "tool_calls": {"function": {}}}], {}, TypeError, "'tool_calls' must be a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], {}, TypeError,
     "a tool call must be"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], {}, ValueError,
     "tool call 'f' has arguments that are not JSON: '{x'"),
    ([{"role": None, "content": "hi"}], {}, TypeError, "'role' must be a string, got None"),
    ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": 5}, TypeError, "chat_template_kwargs"),
    ([{"role": "user", "content": "hi"}], {"chat_template": 5}, TypeError, "chat_template"),
    ([{"role": "user", "content": "hi"}], {"continue_final_message": True}, ValueError,
     "pass add_generation_prompt=False"),
    ([{"role": "user", "content": "hi"}], {"continue_final_message": 1}, TypeError, "continue_final_message"),
    ([{"role": "user", "content": "hi"}], {"tools": {"type": "function"}}, TypeError, "tools must be a list of dicts"),
])
def test_bad_chat_messages(llm, baseline, messages, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert_usable(llm, baseline)


def test_tokenizer_adds_no_bos_so_empty_string_is_an_empty_prompt(llm):
    assert llm.tokenizer.encode("") == []


def test_prompt_exactly_at_max_model_len_is_accepted(llm, baseline):
    out = llm.generate([[7] * 100], SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 28 and out.finish_reason == "length"
    assert_usable(llm, baseline)


def test_failure_during_a_step_aborts_everything_and_engine_stays_usable(llm, baseline, monkeypatch):
    runner = llm.llm_engine.model_runner
    real_run, calls = runner.launch, []

    def failing_run(batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:
            raise RuntimeError("simulated failure in the model")
        return real_run(batch)

    monkeypatch.setattr(runner, "launch", failing_run)
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [11, 12, 13]] * 3
    with pytest.raises(RuntimeError, match="simulated failure"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(calls) == 3
    monkeypatch.setattr(runner, "launch", real_run)
    assert_usable(llm, baseline)


def test_interrupted_step_does_not_poison_the_prefix_cache(qwen3_dir, monkeypatch):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32",
              max_model_len=MAX_LEN, kvcache_block_size=8)  # own engine: this one gets poisoned
    prompt = list(range(200, 240))  # 5 full blocks of 8
    ref = hf_greedy(qwen3_dir, [prompt], 8)[0]

    def interrupted(batch):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.llm_engine.model_runner, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert_greedy_match(out.token_ids, ref["token_ids"], ref["logits"])


# ----------------------------------------------------------------------------------------------------------
# Construction errors
# ----------------------------------------------------------------------------------------------------------

def test_unknown_keyword_is_a_type_error(qwen3_dir):
    with pytest.raises(TypeError, match="max_modle_len"):
        LLM(str(qwen3_dir), device="cpu", dtype="float32", max_modle_len=64)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(max_num_seqs=-1), ValueError, "max_num_seqs"),
    (dict(kvcache_block_size=1.5), TypeError, "kvcache_block_size"),
    (dict(seed="x"), TypeError, "seed"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching"),
    (dict(num_kvcache_blocks=2**40), ValueError, "num_kvcache_blocks"),
    (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size=3 does not divide"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    (dict(tensor_parallel_size="2"), TypeError, "tensor_parallel_size"),
])
def test_bad_engine_argument(qwen3_dir, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(str(qwen3_dir), device="cpu", dtype="float32", **{"max_model_len": 64, **kwargs})


def test_top_k_beyond_the_vocabulary_means_no_filter(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=2**70, seed=3, max_tokens=4),
                       use_tqdm=False)[0]
    ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=3, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_concurrent_generate_calls_take_turns(llm, baseline):
    import threading

    results, errors = {}, []

    def run(i):
        try:
            results[i] = [o.outputs[0].token_ids for o in llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [results[i] for i in range(3)] == [baseline] * 3
    assert_idle(llm)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu", dtype="float32")


def test_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(qwen3_dir, tmp_path):
    d = copy_model(qwen3_dir, tmp_path / "foo")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)


def rewrite_weights(src, dst, edit):
    d = copy_model(src, dst)
    weights = load_file(d / "model.safetensors")
    edit(weights)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("tensor, named", [
    ("model.norm.weight", "model.norm.weight"),
    ("model.layers.2.post_attention_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"),
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),  # fused q/k/v
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),  # fused gate/up
])
def test_checkpoint_missing_a_tensor(qwen3_dir, tmp_path, tensor, named):
    d = rewrite_weights(qwen3_dir, tmp_path / "m", lambda w: w.pop(tensor))
    with pytest.raises(ValueError, match="missing") as e:
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    assert named in str(e.value)


@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.foo.weight", "model.layers.3.input_layernorm.weight",
                                    "extra"])
def test_checkpoint_with_an_unknown_tensor(qwen3_dir, tmp_path, tensor):
    d = rewrite_weights(qwen3_dir, tmp_path / "m", lambda w: w.__setitem__(tensor, torch.ones(64)))
    with pytest.raises(ValueError, match="no parameter") as e:
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    assert repr(tensor) in str(e.value)


def _reshape(name, fn):
    return lambda w: w.__setitem__(name, fn(w[name]))


@pytest.mark.parametrize("tensor, fn", [
    ("model.norm.weight", lambda t: torch.ones(65)),
    ("model.embed_tokens.weight", lambda t: t[:-1]),
    ("model.layers.0.self_attn.o_proj.weight", lambda t: t.T.contiguous()),
    ("model.layers.0.self_attn.q_proj.weight", lambda t: t[:, :-1].contiguous()),
    ("model.layers.1.mlp.gate_proj.weight", lambda t: torch.cat([t, t])),
    ("model.layers.1.mlp.down_proj.weight", lambda t: t[:-1].contiguous()),
    pytest.param("model.layers.0.self_attn.q_proj.weight", lambda t: torch.cat([t, t])),
    pytest.param("model.layers.0.self_attn.k_proj.weight", lambda t: t[:-1].contiguous()),
], ids=["norm", "embed", "o_proj-transposed", "q_proj-in-dim", "gate_proj-rows", "down_proj-rows",
        "q_proj-too-many-rows", "k_proj-too-few-rows"])
def test_checkpoint_tensor_with_wrong_shape(qwen3_dir, tmp_path, tensor, fn):
    d = rewrite_weights(qwen3_dir, tmp_path / "m", _reshape(tensor, fn))
    with pytest.raises(ValueError, match="shape") as e:
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    assert tensor in str(e.value)


def test_model_that_is_not_a_path():
    with pytest.raises(TypeError, match="model must be a path.*5"):
        LLM(5, device="cpu")


@pytest.mark.parametrize("key, value", [("rope_theta", -1), ("rope_theta", 0), ("rms_norm_eps", 0),
                                        ("num_attention_heads", 0), ("head_dim", -32), ("vocab_size", "x")])
def test_bad_model_config_value_names_it_and_the_file(qwen3_dir, tmp_path, key, value):
    d = copy_model(qwen3_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (cfg["rope_parameters"] if key == "rope_theta" else cfg)[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key) as e:
        LLM(str(d), max_model_len=64, device="cpu")
    assert str(d / "config.json") in str(e.value)


def test_bad_attention_chunk_size_names_it_and_the_file(model_dir, tmp_path):
    """Llama 4's chunk size, like the model's other sizes, must be a positive int; chunks shorter than max_model_len
    run (chunked local attention: tests/test_correctness.py)."""
    d = copy_model(model_dir("llama4"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    for value in (0, -8):
        (d / "config.json").write_text(json.dumps({**cfg, "attention_chunk_size": value}))
        with pytest.raises(ValueError, match=f"attention_chunk_size={value} in .* must be a positive int") as e:
            LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
        assert str(d / "config.json") in str(e.value)


def test_quantized_checkpoint_is_refused_by_name(qwen3_dir, tmp_path):
    d = copy_model(qwen3_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # one that does not load
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.*'bitsandbytes'") as e:
        LLM(str(d), max_model_len=64, device="cpu")
    assert str(d / "config.json") in str(e.value)


def _damaged(data: bytes, damage: str) -> bytes:
    garbage = random.Random(0).randbytes(4096)
    return {"truncated": data[:len(data) * 2 // 3], "tail-cut": data[:-64], "empty": b"", "random": garbage,
            "gguf-magic-and-garbage": b"GGUF" + garbage, "header-only": data[:200]}[damage]


@pytest.mark.parametrize("damage", ["truncated", "tail-cut", "empty", "random"])
def test_unreadable_safetensors_names_the_file(qwen3_dir, tmp_path, damage):
    f = copy_model(qwen3_dir, tmp_path / "m") / "model.safetensors"
    f.write_bytes(_damaged(f.read_bytes(), damage))
    with pytest.raises(ValueError, match="cannot read checkpoint file") as e:
        LLM(str(f.parent), max_model_len=64, device="cpu")
    assert str(f) in str(e.value)


def test_truncated_shard_names_the_file(qwen3_sharded_dir, tmp_path):
    shard = sorted(copy_model(qwen3_sharded_dir, tmp_path / "m").glob("*.safetensors"))[2]
    shard.write_bytes(_damaged(shard.read_bytes(), "tail-cut"))
    with pytest.raises(ValueError, match="cannot read checkpoint file") as e:
        LLM(str(shard.parent), max_model_len=64, device="cpu")
    assert str(shard) in str(e.value)


@pytest.mark.parametrize("damage", ["gguf-magic-and-garbage", "truncated", "tail-cut", "header-only", "empty"])
def test_unreadable_gguf_names_the_file(tmp_path, damage):
    from test_gguf import _write_tiny_model
    good, bad = tmp_path / "good.gguf", tmp_path / "bad" / f"{damage}.gguf"
    _write_tiny_model(good, "llama", tied=True)
    bad.parent.mkdir()
    bad.write_bytes(_damaged(good.read_bytes(), damage))
    with pytest.raises(ValueError, match="cannot read GGUF file") as e:
        LLM(str(bad), max_model_len=64, device="cpu")
    assert str(bad) in str(e.value)


def test_only_gguf_checkpoints_need_the_gguf_package(qwen3_dir, tmp_path):
    """gguf is imported when a .gguf file is opened (images with torch preinstalled may lack it): without it,
    safetensors checkpoints load and generate, and a GGUF file gets an ImportError naming the file."""
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    script = f"""
import sys
sys.modules["gguf"] = None  # `import gguf` now raises ImportError, as where it is not installed
from nanoinfer import LLM, SamplingParams
llm = LLM({str(qwen3_dir)!r}, device="cpu", dtype="float32", max_model_len=64)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 2, out
try:
    LLM({str(gguf_file)!r}, device="cpu")
except ImportError as e:
    assert {str(gguf_file)!r} in str(e) and "pip install gguf" in str(e), e
else:
    raise AssertionError("a GGUF file loaded without gguf")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("tensor, named", [("model.norm.weight", "model.norm.weight"),
                                           ("model.layers.0.self_attn.k_proj.weight", "qkv_proj")])
def test_integer_checkpoint_tensor_is_refused(qwen3_dir, tmp_path, tensor, named):
    d = rewrite_weights(qwen3_dir, tmp_path / "m", _reshape(tensor, lambda t: (t * 100).to(torch.int64)))
    with pytest.raises(ValueError, match=f"'{tensor}'.*I64.*{named}.*floating-point") as e:
        LLM(str(d), max_model_len=64, device="cpu")
    assert str(d / "model.safetensors") in str(e.value)


def test_kv_cache_too_small_for_max_model_len(qwen3_dir):
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        LLM(str(qwen3_dir), device="cpu", dtype="float32",
            max_model_len=128, kvcache_block_size=4, num_kvcache_blocks=31)
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32",
              max_model_len=128, kvcache_block_size=4, num_kvcache_blocks=32)
    assert llm.llm_engine.model_runner.num_kvcache_blocks == 32


def test_failed_start_up_frees_the_model_while_the_error_is_kept(qwen3_dir, monkeypatch):
    """A start-up failing after the model is loaded (here: a KV cache larger than memory) gives the model back at
    once, though the caller keeps the exception, whose traceback holds the runner's frames: on CUDA its GPU memory
    would stay taken until then. The garbage collector is off, so nothing waits for a collection."""
    loaded = []

    def recording_load(config, device):
        model = load(config, device)
        loaded.append(weakref.ref(model))
        return model

    load = ModelRunner._load_model
    monkeypatch.setattr(ModelRunner, "_load_model", staticmethod(recording_load))
    gc.disable()
    try:
        with pytest.raises(ValueError, match="num_kvcache_blocks=1099511627776 needs") as error:
            LLM(str(qwen3_dir), device="cpu", max_model_len=64, num_kvcache_blocks=2**40)
        assert error.value.__traceback__ is not None and len(loaded) == 1
        assert loaded[0]() is None, "the model outlives the failed start-up"
    finally:
        gc.enable()


def test_start_up_failing_mid_build_frees_the_modules_built(qwen3_dir, tmp_path, monkeypatch):
    """A model whose build fails part-way (an unsupported rope type, found by its first attention layer) leaves none
    of the modules built so far alive while the caller keeps the error, though that error is re-raised `from None`
    on the way (its hidden context's frames hold them too). Garbage collector off, as above."""
    bad = tmp_path / "dynamic-rope"
    shutil.copytree(qwen3_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    (bad / "config.json").write_text(json.dumps(config))
    built, init = [], torch.nn.Module.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(torch.nn.Module, "__init__", recording_init)
    gc.disable()
    try:
        with pytest.raises(ValueError, match="dynamic") as error:
            LLM(str(bad), device="cpu", max_model_len=64)
        assert error.value.__traceback__ is not None and built
        assert [type(r()).__name__ for r in built if r() is not None] == []
    finally:
        gc.enable()


# ----------------------------------------------------------------------------------------------------------
# Load test: a tiny cache forces preemption and recompute; greedy outputs must not change
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_many_short_requests_with_a_tiny_kv_cache(qwen3_dir):
    rng = random.Random(1)
    n = 2000
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True) for _ in range(n)]
    # Some repeated prompts and shared prefixes so the prefix cache is exercised under pressure too.
    for i in range(0, n, 10):
        prompts[i] = prompts[i - 5][:] if i >= 5 else prompts[i]
        prompts[i + 1] = prompts[i][:8] + prompts[i + 1][:4]

    small = LLM(str(qwen3_dir), device="cpu", dtype="float32",
                max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=64, max_num_seqs=256)
    outs = small.generate(prompts, params, use_tqdm=False)
    engine = small.llm_engine
    assert len(outs) == n
    for out, prompt, p in zip(outs, prompts, params):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == p.max_tokens and out.outputs[0].finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    assert_idle(small)

    roomy = LLM(str(qwen3_dir), device="cpu", dtype="float32",
                max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=2048, max_num_seqs=256)
    ref = roomy.generate(prompts, params, use_tqdm=False)
    assert roomy.llm_engine.scheduler.num_preemptions == 0
    mismatches = [i for i, (a, b) in enumerate(zip(outs, ref)) if a.outputs[0].token_ids != b.outputs[0].token_ids]
    assert not mismatches, f"{len(mismatches)} outputs differ, e.g. #{mismatches[0]}"


def test_an_eos_id_outside_the_vocabulary_is_ignored(qwen3_dir, tmp_path, caplog):
    """A config's EOS id past a small vocabulary (a default kept, as GPT-2's 50256) can never be sampled; withheld by
    min_tokens it indexed past the logits (a device assert on CUDA, ending the process's CUDA context): it is
    ignored, with a warning naming it and the model."""
    d = tmp_path / "eos-outside"
    shutil.copytree(qwen3_dir, d)
    for name in ("config.json", "generation_config.json"):
        if (d / name).exists():
            config = json.loads((d / name).read_text())
            config["eos_token_id"] = [config["eos_token_id"]] if isinstance(config["eos_token_id"], int) else []
            config["eos_token_id"] += [600]
            (d / name).write_text(json.dumps(config))
    params = SamplingParams(temperature=0.8, seed=1, min_tokens=3, max_tokens=5)
    with LLM(str(d), device="cpu", max_model_len=64) as llm:
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) >= 3
    assert "EOS token ids [600]" in caplog.text and str(d) in caplog.text


def test_params_changed_after_add_request_do_not_reach_the_model(qwen3_dir):
    """The engine keeps its own copy of a request's params (and their lists and dicts), checked when it was added:
    ids the caller puts in them afterwards (here out of the vocabulary: an index past the logits, a device assert on
    CUDA) change nothing."""
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, allowed_token_ids=[5, 9, 11],
                                logit_bias={5: 1.0}, stop_token_ids=[7])
        engine.add_request("r", [5, 6, 7], params)
        params.allowed_token_ids.append(10**6)
        params.logit_bias[10**6] = 1.0
        params.stop_token_ids.append(10**6)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert len(done) == 1 and set(done[0].outputs[0].token_ids) <= {5, 9, 11}
