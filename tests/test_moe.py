"""Qwen3-MoE: the fused expert layer against transformers' own MoE block, its tensor-parallel shards, which
layers are sparse, and checkpoint mapping errors. (Whole-model greedy/logits: test_correctness.py.)"""
import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoinfer.layers.fused_moe as fused_moe
from models import make_config
from nanoinfer import LLM
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from nanoinfer.utils.loader import load_weights


def hf_block(renormalize: bool, seed: int = 0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFBlock

    config = make_config("qwen3-moe")
    config.norm_topk_prob = renormalize
    torch.manual_seed(seed)
    block = HFBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return config, block


def expert_checkpoint(block) -> dict[str, torch.Tensor]:
    """The block's weights as a checkpoint stores them: one gate/up/down matrix per expert."""
    inter = block.experts.intermediate_dim
    tensors = {"mlp.gate.weight": block.gate.weight.detach()}
    for e in range(block.experts.num_experts):
        gate_up, down = block.experts.gate_up_proj[e].detach(), block.experts.down_proj[e].detach()
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[:inter]
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[inter:]
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down
    return tensors


class Wrapper(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = Qwen3MoeSparseMoeBlock(config)


@pytest.mark.parametrize("renormalize", [True, False])
@torch.inference_mode()
def test_moe_block_matches_transformers(renormalize):
    config, ref = hf_block(renormalize)
    ours = Wrapper(config)
    load_weights(ours, expert_checkpoint(ref).items())
    x = torch.randn(37, config.hidden_size)
    expected = ref(x.unsqueeze(0))[0]
    got = ours.mlp(x)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.abs().mean().item() > 0.1  # not a trivially small output


@torch.inference_mode()
def test_moe_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks' halves of every expert's intermediate dimension add up (the all-reduce) to the full output."""
    config, ref = hf_block(True, seed=1)
    x = torch.randn(11, config.hidden_size)
    full = FusedMoE(8, 2, config.hidden_size, 32, renormalize=True)
    load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": full})}),
                 [(k, v) for k, v in expert_checkpoint(ref).items() if ".experts." in k])
    logits = x @ ref.gate.weight.T
    parts = []
    for rank in range(2):
        monkeypatch.setattr(fused_moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(fused_moe, "tp_size", lambda: 2)
        shard = FusedMoE(8, 2, config.hidden_size, 32, renormalize=True, reduce_results=False)
        assert shard.w13_weight.shape == (8, 32, config.hidden_size) and shard.w2_weight.shape == (8, config.hidden_size, 16)
        for name, tensor in expert_checkpoint(ref).items():
            target = fused_moe.expert_weight_target(name)
            if target is not None:
                shard.weight_loader(getattr(shard, target[0].rsplit(".", 1)[1]), tensor, target[1])
        parts.append(shard(x, logits))
    whole = full(x, logits)
    assert (parts[0] + parts[1] - whole).abs().max().item() < 1e-5
    assert (parts[0] - whole).abs().max().item() > 1e-2  # each rank alone is only part of it


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = make_config("qwen3-moe")
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 6, 2, [3]
    model = Qwen3MoeForCausalLM(config)
    sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
    assert sparse == [False, True, False, False, False, True]


def test_missing_or_extra_expert_is_reported(model_dir, tmp_path):
    d = model_dir("qwen3-moe")
    weights = load_file(d / "model.safetensors")
    for name, change in [("model.layers.2.mlp.experts.5.up_proj.weight", "drop"),
                         ("model.layers.0.mlp.experts.8.gate_proj.weight", "add")]:
        broken = tmp_path / change
        broken.mkdir()
        for f in d.iterdir():
            if f.suffix != ".safetensors":
                (broken / f.name).write_bytes(f.read_bytes())
        tensors = dict(weights)
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = weights["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()
        save_file(tensors, broken / "model.safetensors")
        with pytest.raises(ValueError, match="missing weights.*w13_weight" if change == "drop" else "expert 8"):
            LLM(str(broken), device="cpu", dtype="float32", max_model_len=64)
