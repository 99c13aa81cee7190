"""``interlace.nn.parallelize`` on transformers Llama, Qwen2 (biased QKV) and Mixtral
(sparse MoE) models built from tiny configs with random weights, and on the plain decoder
stack of ``interlace.bench.model`` (where transformers is missing, as on the GPU machine):
the parallelized bf16 model's logits and one training step's gradients (every weight
shard, the norms, embeddings and LM head) against the same model in float32 on one
device, with a batch of 2 and a sequence that does not split evenly over the ranks."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import interlace.nn as inn
from interlace.errors import InterlaceTypeError, InterlaceValueError
from tests.nn._models import MODEL_TOL, rel, worlds
from tests.ops._helpers import expect_error

HAVE_HF = importlib.util.find_spec("transformers") is not None
VOCAB = 96


def _hf_model(kind: str):
    import transformers as T

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    elif kind == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    else:
        cfg = T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = T.MixtralForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


class _PlainLM(nn.Module):
    """The bench's plain decoder stack with an embedding and an LM head."""

    def __init__(self):
        super().__init__()
        from interlace.bench.model import DecoderConfig, DecoderStack

        c = DecoderConfig(hidden=64, intermediate=96, heads=8, kv_heads=4, head_dim=8, layers=2)
        self.embed = nn.Embedding(VOCAB, c.hidden)
        self.model = DecoderStack(c)
        self.lm_head = nn.Linear(c.hidden, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.1)

    def forward(self, ids):
        return self.lm_head(self.model(self.embed(ids)))


def _build(kind: str):
    torch.manual_seed(0)
    return _PlainLM() if kind == "plain" else _hf_model(kind)


def _logits(model, ids):
    out = model(ids) if isinstance(model, _PlainLM) else model(ids, use_cache=False).logits
    return out


def _expected(layer, ref_layer):
    """(parallel tensor's gradient, this rank's slice of the reference gradient) pairs of
    one decoder layer."""
    a, ra = layer.self_attn, ref_layer.self_attn
    pairs = [
        (a.qkv.weight, a.qkv.shard(torch.cat([ra.q_proj.weight.grad, ra.k_proj.weight.grad,
                                              ra.v_proj.weight.grad]))),
        (a.o.weight, a.o.shard(ra.o_proj.weight.grad)),
        (layer.input_layernorm.weight, ref_layer.input_layernorm.weight.grad),
        (layer.post_attention_layernorm.weight, ref_layer.post_attention_layernorm.weight.grad),
    ]  # fmt: skip
    if a.qkv.bias is not None:
        full = torch.cat([ra.q_proj.bias.grad, ra.k_proj.bias.grad, ra.v_proj.bias.grad])
        pairs.append((a.qkv.bias, a.qkv.shard(full)))
    m, rm = layer.mlp, ref_layer.mlp
    if isinstance(m, inn.MoEBlock):
        pairs += [
            (m.router, rm.gate.weight.grad),
            (m.gate_up, m.shard_gate_up(rm.experts.gate_up_proj.grad)),
            (m.down, m.shard_down(rm.experts.down_proj.grad)),
        ]
    else:
        full = torch.cat([rm.gate_proj.weight.grad, rm.up_proj.weight.grad])
        pairs += [(m.gate_up.weight, m.gate_up.shard(full)),
                  (m.down.weight, m.down.shard(rm.down_proj.weight.grad))]  # fmt: skip
    return pairs


def _parallelize_body(group, kind, strategy):
    ref = _build(kind).float()
    with torch.no_grad():  # the float32 reference holds the bf16 model's exact weights
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16))
    model = copy.deepcopy(ref).to(torch.bfloat16)
    moe = "fused" if kind == "mixtral" else "auto"  # (passed through to every MoEBlock)
    inn.parallelize(model, group, strategy=strategy, moe_strategy=moe)
    ref = ref.to(group.device)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    ids = ids.to(group.device)
    errors = {}
    for step in range(2):  # two steps: the contexts are reused, gradients accumulate
        logits, ref_logits = _logits(model, ids), _logits(ref, ids)
        errors[f"logits {step}"] = rel(logits, ref_logits)
        logits.float().logsumexp(-1).mean().backward()
        ref_logits.logsumexp(-1).mean().backward()
    layers, ref_layers = inn.decoder_layers(model), inn.decoder_layers(ref)
    for i, (layer, ref_layer) in enumerate(zip(layers, ref_layers)):
        for j, (p, want) in enumerate(_expected(layer, ref_layer)):
            errors[f"layer {i} grad {j}"] = rel(p.grad, want)
    named_ref = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # embeddings, final norm, LM head
        if "layers." not in name:
            errors[name] = rel(p.grad, named_ref[name].grad)
    assert len(errors) > 10
    if kind == "mixtral":
        blocks = [layer.mlp for layer in layers]
        assert all(isinstance(b, inn.MoEBlock) for b in blocks)
        assert all(b.strategy == "fused" and b.last_strategy == "fused" for b in blocks)
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v < MODEL_TOL}
    assert not bad, f"{kind} W={group.world_size}: {bad}"
    return max(errors.values())


CASES = [
    pytest.param("llama", "fused", ("cpu", 2), id="llama-fused-cpu2"),
    # four ranks on two cores: the layers and sequence-parallel wiring with ``auto`` (which
    # runs cuBLAS-style local GEMMs + collectives at this size); the fused kernels at W = 2
    pytest.param("llama", "auto", ("cpu", 4), id="llama-auto-cpu4"),
    pytest.param("qwen2", "auto", ("cpu", 2), id="qwen2-auto-cpu2"),
    pytest.param("mixtral", "auto", ("cpu", 2), id="mixtral-auto-cpu2"),
]


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed (pip install interlace[hf])")
@pytest.mark.parametrize("kind, strategy, world", CASES, indirect=["world"])
def test_transformers_model_matches_single_device(world, kind, strategy):
    world.run(_parallelize_body, kind, strategy)


@pytest.mark.parametrize("world", worlds(cpu=(2,)), indirect=True)
def test_plain_decoder_matches_single_device(world):
    """The bench's plain decoder (no transformers needed: the GPU machine's test)."""
    world.run(_parallelize_body, "plain", "fused" if world.backend == "cpu" else "auto")


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
@pytest.mark.parametrize("world", worlds(cpu=(), gpu=(2, 4)), indirect=True)
def test_transformers_llama_on_gpu(world):
    world.run(_parallelize_body, "llama", "auto")


def _bad_body(group):
    expect_error(InterlaceValueError, "decoder layers", inn.parallelize, nn.Linear(2, 2), group)
    expect_error(InterlaceTypeError, "Group", inn.parallelize, _build("plain"), "group")
    model = _build("plain")
    model.model.layers[0].mlp = nn.Identity()
    expect_error(InterlaceValueError, "cannot parallelize the MLP", inn.parallelize, model, group)
    return True


@pytest.mark.parametrize("world", worlds(cpu=(2,), gpu=()), indirect=True)
def test_bad_models_raise_on_every_rank(world):
    assert world.run(_bad_body) == [True] * world.world_size
