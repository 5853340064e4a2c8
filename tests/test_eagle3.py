"""The EAGLE-3 feature drafter (models.eagle3, drafters.eagle3): the head loaded from a hand-made
checkpoint in the published layout and checked against a float64 forward written here from the
format's description; heads that do not fit the target refused by name; the target's captured
features against transformers' output_hidden_states on every backend and through forwards cut
by layers; in the engine, greedy output equal to target-only on every path, the exact sampling
distribution, seeded sampling the same at batch 1 and 3, and the prefix cache changing nothing."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from specengine import Engine, SamplingParams
from specengine.drafters.eagle3 import Eagle3Drafter
from specengine.models.config import CheckpointError, ConfigError
from specengine.models.eagle3 import Eagle3Head, is_eagle3_folder, load_eagle3

from engine_util import tiny_model

HEADS, KV_HEADS = 4, 2


# ---- hand-made heads in the published layout ------------------------------------------------

def head_tensors(target, seed=0, layer_ids=(0, 1, 2), draft_ids=None, prefix="midlayer.", embed=False,
                 scale=0.3, head_scale=2.0):
    """Random weights of an EAGLE-3 head for `target`, named as EAGLE's checkpoints name them
    (prefix "midlayer."; vLLM's own is "layers.0."). draft_ids: the target ids of its draft
    vocabulary, in order (None: the whole vocabulary)."""
    tc = target.config
    H, V, hd = tc.hidden_size, tc.vocab_size, tc.hidden_size // HEADS
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=scale: torch.randn(*shape, generator=g) * s  # noqa: E731
    ids = torch.arange(V) if draft_ids is None else torch.tensor(draft_ids)
    t = {"fc.weight": r(H, len(layer_ids) * H), "norm.weight": 1 + r(H), "lm_head.weight": r(len(ids), H, s=head_scale),
         "d2t": ids - torch.arange(len(ids)), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)}
    layer = {"hidden_norm.weight": 1 + r(H), "input_layernorm.weight": 1 + r(H),
             "post_attention_layernorm.weight": 1 + r(H),
             "self_attn.q_proj.weight": r(HEADS * hd, 2 * H), "self_attn.k_proj.weight": r(KV_HEADS * hd, 2 * H),
             "self_attn.v_proj.weight": r(KV_HEADS * hd, 2 * H), "self_attn.o_proj.weight": r(H, HEADS * hd),
             "mlp.gate_proj.weight": r(2 * H, H), "mlp.up_proj.weight": r(2 * H, H), "mlp.down_proj.weight": r(H, 2 * H)}
    t.update({prefix + k: v for k, v in layer.items()})
    if embed:
        t["embed_tokens.weight"] = r(V, H, s=1.0)
    return t


def head_config(target, layer_ids=(0, 1, 2), draft_vocab=None, **overrides):
    tc = target.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": tc.hidden_size,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": tc.hidden_size // HEADS,
              "intermediate_size": 2 * tc.hidden_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "num_hidden_layers": 1, "max_position_embeddings": 2048,
              "vocab_size": tc.vocab_size, "draft_vocab_size": draft_vocab or tc.vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}
    config.update(overrides)
    return config


def write_head(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# ---- the published computation in float64, from the format's description (not the module) ----

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta=10000.0):
    """Rotary embedding, rotate-half form; x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.double()[:, None] * inv
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def reference_chain(t, embedding, features, tokens, chain, draft_ids=None, prefix="midlayer."):
    """Outputs and target-vocabulary logits of an EAGLE-3 head, float64: pairs (fc(features[i]),
    tokens[i]) at positions 0..P-1, then chain tokens, each paired with the output before it.
    t: the checkpoint's tensors; embedding [V, H]."""
    d = {k: v.double() for k, v in t.items() if v.is_floating_point()}
    L = lambda name: d[prefix + name]  # noqa: E731
    H = embedding.shape[1]
    hd = H // HEADS
    keys, values, outs = [], [], []
    hiddens = list(features.double() @ d["fc.weight"].T)
    all_tokens = list(tokens) + list(chain)
    for pos, token in enumerate(all_tokens):
        hidden = hiddens[pos] if pos < len(hiddens) else outs[-1]
        x = torch.cat([_rms(embedding[token].double(), L("input_layernorm.weight")),
                       _rms(hidden, L("hidden_norm.weight"))])
        p = torch.tensor([pos])
        q = _rope((x @ L("self_attn.q_proj.weight").T).view(1, HEADS, hd), p)[0]
        keys.append(_rope((x @ L("self_attn.k_proj.weight").T).view(1, KV_HEADS, hd), p)[0])
        values.append((x @ L("self_attn.v_proj.weight").T).view(KV_HEADS, hd))
        K, Vv = torch.stack(keys), torch.stack(values)  # [pos + 1, kv heads, hd]
        group = HEADS // KV_HEADS
        heads = []
        for h in range(HEADS):
            w = torch.softmax(K[:, h // group] @ q[h] / math.sqrt(hd), 0)
            heads.append(w @ Vv[:, h // group])
        y = hidden + torch.cat(heads) @ L("self_attn.o_proj.weight").T
        m = _rms(y, L("post_attention_layernorm.weight"))
        gate, up = m @ L("mlp.gate_proj.weight").T, m @ L("mlp.up_proj.weight").T
        outs.append(y + (torch.nn.functional.silu(gate) * up) @ L("mlp.down_proj.weight").T)
    out = torch.stack(outs)
    scores = _rms(out, d["norm.weight"]) @ d["lm_head.weight"].T
    V = embedding.shape[0]
    logits = torch.full((len(outs), V), float("-inf"), dtype=torch.float64)
    ids = torch.arange(scores.shape[1]) + t["d2t"]
    logits[:, ids] = scores
    return out, logits


@pytest.fixture(scope="module")
def target():
    return tiny_model(32, seed=0, logit_scale=3.0)


def test_the_head_computes_the_published_forward(target, tmp_path):
    """A checkpoint in EAGLE's layout (midlayer.*, a trimmed vocabulary with d2t) loads, and its
    pairs fed in two pieces then two chain steps give the float64 forward's outputs and logits."""
    draft_ids = [3, 0, 7, 9, 12, 13, 20, 21, 25, 31, 30, 1]
    t = head_tensors(target, draft_ids=draft_ids)
    folder = write_head(tmp_path / "head", head_config(target, draft_vocab=len(draft_ids)), t)
    assert is_eagle3_folder(folder) and not is_eagle3_folder(tmp_path)
    head = load_eagle3(folder, target)
    assert head.config.feature_layers == (0, 1, 2) and head.embed_tokens is None
    g = torch.Generator().manual_seed(1)
    features = torch.randn(7, 3 * 32, generator=g)
    tokens = torch.randint(0, 32, (7,), generator=g).tolist()
    chain = [5, 17]
    ref_out, ref_logits = reference_chain(t, target.model.embed_tokens.weight, features, tokens, chain)
    cache = head.new_cache(1, 16)
    outs = []
    for a, b in ((0, 4), (4, 7)):  # the pairs in two calls
        outs.append(head(torch.tensor([tokens[a:b]]), torch.tensor([a]), cache, hidden=head.fuse(features[None, a:b]))[0])
    hidden = outs[-1][-1:][None]
    for i, token in enumerate(chain):  # each chain step feeds back the output before it
        hidden = head(torch.tensor([[token]]), torch.tensor([7 + i]), cache, hidden=hidden)
        outs.append(hidden[0])
    out = torch.cat(outs)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    logits = head.logits(out)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref_logits))
    finite = torch.isfinite(ref_logits)
    torch.testing.assert_close(logits.double()[finite], ref_logits[finite], rtol=1e-4, atol=1e-4)


def test_vllm_names_an_own_embedding_and_norm_before_residual(target, tmp_path):
    """layers.0.* names (vLLM's), a head's own embed_tokens, and norm_before_residual (the residual is
    then the normed hidden: checked by planting it in the reference's hidden)."""
    t = head_tensors(target, seed=2, prefix="layers.0.", embed=True)
    head = load_eagle3(write_head(tmp_path / "head", head_config(target), t), target)
    assert head.embed_tokens is not None
    features = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    tokens = [4, 8, 15]
    ref_out, _ = reference_chain(t, t["embed_tokens.weight"], features, tokens, [], prefix="layers.0.")
    out = head(torch.tensor([tokens]), torch.tensor([0]), head.new_cache(1, 8), hidden=head.fuse(features[None]))[0]
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    other = load_eagle3(write_head(tmp_path / "nbr", head_config(target, norm_before_residual=True), t), target)
    moved = other(torch.tensor([tokens]), torch.tensor([0]), other.new_cache(1, 8), hidden=other.fuse(features[None]))[0]
    assert not torch.allclose(moved, out, atol=1e-3)


@pytest.mark.parametrize("change, match", [
    (dict(config=dict(vocab_size=40)), "vocab_size 40 is not the target's 32"),
    (dict(config=dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]})),
     r"eagle_aux_hidden_state_layer_ids \[0, 1, 5\] must be distinct ids of the target's 2 layers"),
    (dict(config=dict(eagle_config={})), r"eagle_aux_hidden_state_layer_ids \[2, 1, -1\]"),  # the default ids
    (dict(config=dict(target_hidden_size=64)), "reads states of width 64"),
    (dict(config=dict(num_hidden_layers=2)), "one decoder layer"),
    (dict(config=dict(architectures=["LlamaForCausalLM"])), "not an EAGLE-3 head"),
    (dict(tensors={"d2t": torch.full((32,), 3)}), "d2t maps draft ids to target ids outside"),
    (dict(tensors={"fc.weight": torch.zeros(32, 64)}), r"fc.weight has shape \(32, 64\)"),
    (dict(tensors={"midlayer.self_attn.q_proj.weight": torch.zeros(32, 32)}), "q_proj.weight has shape"),
    (dict(tensors={"midlayer.extra.weight": torch.zeros(2)}), "tensors an EAGLE-3 head does not have: extra"),
    (dict(drop="norm.weight"), "EAGLE-3 head tensors missing: norm.weight"),
    (dict(config=dict(hidden_size=64, head_dim=16, intermediate_size=128)), "reads states of width 64"),
])
def test_a_head_that_does_not_fit_is_refused_by_name(target, tmp_path, change, match):
    config = head_config(target)
    config.update(change.get("config", {}))
    tensors = head_tensors(target)
    tensors.update(change.get("tensors", {}))
    tensors.pop(change.get("drop", ""), None)
    with pytest.raises((ConfigError, CheckpointError), match=match):
        load_eagle3(write_head(tmp_path / "head", config, tensors), target)


# ---- the target's features -------------------------------------------------------------------

LAYER_OPS = {"whole-layer": "cpp-layers", "cpp-ops": "cpp-ops", "torch-ops": "torch", "triton": "triton"}


@pytest.mark.parametrize("layer_ops", list(LAYER_OPS))
def test_features_are_transformers_hidden_states(layer_ops, checkpoint):
    """The states entering layers 1 and 0 and leaving the last (transformers' output_hidden_states[i]) on each backend,
    whole and through a forward cut between layers (PartialForward, chunked prefill's)."""
    from transformers import AutoModelForCausalLM

    from specengine.models import load_model

    if layer_ops == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton path runs here in the interpreter, on CPU tensors")
    folder = checkpoint("llama3-rope-gqa", torch.bfloat16 if layer_ops == "whole-layer" else torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder)
    if layer_ops != "whole-layer":
        ours.use_backend(LAYER_OPS[layer_ops])
    assert ours.backend.name == LAYER_OPS[layer_ops]
    L = ours.config.num_layers
    ids = (1, L, 0)  # L: the last layer's output before the final norm (transformers' last state is after it)
    ours.capture_features(ids)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = hf(tokens, output_hidden_states=True).hidden_states
    norm = hf.model.norm
    expected = torch.cat([states[1], states[L], states[0]], -1)
    with torch.inference_mode():
        cache = ours.new_cache(2, 16)
        ours(tokens, torch.zeros(2, dtype=torch.int64), cache)
        whole = ours.features
        run, cut = ours.start_forward(tokens, torch.zeros(2, dtype=torch.int64)), ours.new_cache(2, 16)
        assert ours.forward_layers(run, cut, layers=1) is None
        ours.forward_layers(run, cut)
    assert whole.shape == (2, 9, 3 * ours.config.hidden_size) and whole.dtype == torch.float32
    H = ours.config.hidden_size
    with torch.no_grad():
        whole_normed = torch.cat([whole[..., :H], norm(whole[..., H:2 * H]), whole[..., 2 * H:]], -1)
    torch.testing.assert_close(whole_normed, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run.features, whole, rtol=0, atol=0)


def test_capture_refuses_layers_the_target_lacks(target):
    with pytest.raises(ValueError, match=r"feature layers must be distinct layer ids in \[0, 2\]"):
        target.capture_features((0, 3))
    with pytest.raises(ValueError, match="distinct"):
        target.capture_features((1, 1))
