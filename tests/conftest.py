"""Shared pytest fixtures: tiny local test models (see tests/models.py).

Fixtures (all session-scoped, built once per session under a tmp dir; the directory
name of every model is its kind, e.g. `qwen3_dir.name == "qwen3"`):

    model_dir            factory: model_dir(kind) -> pathlib.Path   (kind in models.ALL_KINDS)
    qwen3_dir            Qwen3, tied embeddings, GQA 4q/2kv, head_dim 32
    qwen3_untied_dir     Qwen3, untied, MHA 4/4, head_dim 16
    qwen2_dir            Qwen2, q/k/v bias, GQA 4q/2kv, untied
    llama_dir            Llama, llama3 rope scaling, GQA 4q/2kv, eos = [0, 4]
    qwen3_sharded_dir    same weights as qwen3_dir, saved as 4 safetensors shards + index
    (model_dir(models.ODD_KIND): Qwen2, vocabulary 509, 4q/1kv heads, for tensor parallelism)
    any_model_dir        parametrized over the 4 main kinds (qwen3, qwen3-untied, qwen2, llama)

Env: NANOINFER_TEST_THREADS (default 2) -> torch.set_num_threads.
Markers: `slow`; `cuda` (skipped, with the reason, where no CUDA device is visible); `wide` (the CUDA tests of
families beyond those the GPU issues name).
Every other test pins device="cpu", so the suite is the same on a GPU machine.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib
import sys

import pytest
import torch
import transformers

_TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import models  # noqa: E402  (tests/models.py)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one; select with -m cuda)")
    torch.set_num_threads(int(os.environ.get("NANOINFER_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Factory: model_dir(kind) -> Path of a built model (cached per session)."""
    root = tmp_path_factory.mktemp("nanoinfer_models")
    built: dict[str, pathlib.Path] = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in (*models.ALL_KINDS, models.ODD_KIND):
            raise ValueError(f"unknown model kind {kind!r}; expected one of {(*models.ALL_KINDS, models.ODD_KIND)}")
        family = models.NEWEST_FAMILIES.get(kind)
        if family is not None and importlib.util.find_spec(f"transformers.models.{family}") is None:
            pytest.skip(f"transformers {transformers.__version__} has no {family!r} family (the reference)")
        if (reason := models.unusable_reference(kind)) is not None:
            pytest.skip(reason)
        if kind not in built:
            built[kind] = models.build_model(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def qwen3_dir(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="session")
def qwen3_untied_dir(model_dir):
    return model_dir("qwen3-untied")


@pytest.fixture(scope="session")
def qwen2_dir(model_dir):
    return model_dir("qwen2")


@pytest.fixture(scope="session")
def llama_dir(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="session")
def qwen3_sharded_dir(model_dir):
    return model_dir("qwen3-sharded")


@pytest.fixture(scope="session", params=list(models.MODEL_KINDS), ids=list(models.MODEL_KINDS))
def any_model_dir(request, model_dir):
    return model_dir(request.param)


_LOGIT_DIFFS = pytest.StashKey[dict]()


@pytest.fixture
def report_logit_diff(request):
    """report(name, value): listed at the end of the run, so every CI log shows how close the logits were."""
    def report(name: str, value: float) -> None:
        request.config.stash.setdefault(_LOGIT_DIFFS, {})[name] = value
    return report


def pytest_terminal_summary(terminalreporter, config):
    diffs = config.stash.get(_LOGIT_DIFFS, {})
    if diffs:
        terminalreporter.write_sep("-", "max |logit diff| nanoinfer vs transformers (fp32)")
        for name, value in sorted(diffs.items()):
            terminalreporter.write_line(f"{name}: {value:.2e}")


@pytest.fixture
def ieee_fp32_matmul():
    """cuBLAS's fp32 matmuls without TF32 for the test (torch's default; set in case something turned it on). Not
    monkeypatch: its undo (pytest 9.2) deletes an attribute it did not find in the instance's __dict__, and
    torch.backends.cuda.matmul serves allow_tf32 from __getattr__, so the undo raised AttributeError."""
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, False
    yield
    matmul.allow_tf32 = before


@pytest.fixture(autouse=True)
def _close_tensor_parallel_engines():
    """A failed test's traceback (pytest keeps it as sys.last_traceback) keeps its tensor-parallel LLM alive, and with
    it torch.distributed's process group, which every later tensor-parallel LLM in this process would find taken:
    close any such engine after each test, so one failure does not fail the tests after it."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from nanoinfer.engine.llm_engine import LLMEngine
        for engine in [o for o in gc.get_objects() if issubclass(type(o), LLMEngine) and not o.closed]:
            engine.close()


@pytest.fixture
def captured_logits(monkeypatch) -> dict[int, list[torch.Tensor]]:
    """The logits the engine sampled each token from, per request id (n=1 requests), in step order."""
    from nanoinfer.engine.model_runner import ModelRunner

    captured: dict[int, list[torch.Tensor]] = {}
    sample = ModelRunner.sample

    def recording_sample(self, seqs, logits):
        for seq, row in zip(seqs, logits):
            captured.setdefault(seq.request_id, []).append(row.clone())
        return sample(self, seqs, logits)

    monkeypatch.setattr(ModelRunner, "sample", recording_sample)
    return captured


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} sees none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
