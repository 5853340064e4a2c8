"""recipes/train_eagle3.py in miniature (a tiny 4-layer target): every stage end to end into a
folder in the published EAGLE-3 format, resumed without redoing work; and its pieces: the captured
states are the capture layers' inputs, the training-time test attends as a drafted chain does,
the requests keep the benchmark and the held-out split apart."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specengine.devtools.tiny import make_config, save_random_checkpoint
from specengine.layers.rotary import RopeConfig
from specengine.models.eagle3 import Eagle3Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
import eagle3_head  # noqa: E402
import eagle3_requests  # noqa: E402
import train_eagle3  # noqa: E402
from eagle3_head import Eagle3Head, rope  # noqa: E402

from bounds import Float64Eagle3, Float64Llama, certain_argmax  # noqa: E402
from server_util import CHATML  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 4
TINY = ["--project-requests", "24", "--self-requests", "4", "--self-max-tokens", "8", "--heldout-share", "4",
        "--heldout-requests", "6", "--teach-batch", "8", "--max-new", "8", "--draft-vocab", "64", "--aux-layers", "1,2,3",
        "--ttt-steps", "3", "--batch-tokens", "512", "--seq-cap", "128", "--save-seconds", "0", "--progress-heldout", "2",
        "--train-minutes", "10"]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("eagle3") / "target"
    tokenizer.chat_template = CHATML
    config = make_config(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, eos_token_id=tokenizer.eos_token_id)
    save_random_checkpoint(folder, config, tokenizer, seed=0, init_std=0.3)
    return folder


def run(work: Path, out: Path, target: Path, steps: int):
    train_eagle3.main(["--work", str(work), "--out", str(out), "--target", str(target), "--max-steps", str(steps), *TINY])


def test_the_recipe_exports_the_published_format_and_resumes(target, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "head"
    run(work, out, target, steps=2)
    first = capsys.readouterr().out
    assert "teach train:" in first and "features:" in first and "train: step 2" in first and f"wrote {out}" in first

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 64 and cfg["hidden_size"] == HIDDEN and cfg["target_hidden_size"] == HIDDEN
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    V, H, d, I = cfg["vocab_size"], HIDDEN, HIDDEN // HEADS, cfg["intermediate_size"]
    want = {
        "fc.weight": [H, 3 * H], "midlayer.hidden_norm.weight": [H], "midlayer.input_layernorm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [HEADS * d, 2 * H], "midlayer.self_attn.k_proj.weight": [KV_HEADS * d, 2 * H],
        "midlayer.self_attn.v_proj.weight": [KV_HEADS * d, 2 * H], "midlayer.self_attn.o_proj.weight": [H, HEADS * d],
        "midlayer.mlp.gate_proj.weight": [I, H], "midlayer.mlp.up_proj.weight": [I, H], "midlayer.mlp.down_proj.weight": [H, I],
        "midlayer.post_attention_layernorm.weight": [H], "norm.weight": [H], "lm_head.weight": [64, H],
        "d2t": [64], "t2d": [V],
    }
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(want)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: list(t.shape) for k, t in tensors.items()} == want
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in ("d2t", "t2d"))
    target_ids = torch.arange(64) + tensors["d2t"]
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and int(tensors["t2d"].sum()) == 64
    assert bool(tensors["t2d"][target_ids].all())
    vocab = json.loads((work / "vocab.json").read_text())
    assert target_ids.tolist() == vocab["ids"] and 0 < vocab["coverage_train"] <= 1

    metrics = json.loads((out / "eval.json").read_text())
    for kind in ("t0", "t1"):
        assert len(metrics[kind]["accept_by_position"]) == 3 and metrics[kind]["chains"] > 0
        by_pos = metrics[kind]["accept_by_position"]
        assert all(0 <= b <= a <= 1 for a, b in zip(by_pos, by_pos[1:]))  # a chain is accepted in order
    card = (out / "README.md").read_text()
    assert "Measured acceptance" in card and "Time on this CPU" in card

    # Again with the same budget: nothing is taught, featurised or trained twice.
    teach_state = (work / "teach-train.json").read_text()
    weights = torch.load(work / "head.pt", weights_only=True)["model"]
    run(work, tmp_path / "again", target, steps=2)
    second = capsys.readouterr().out
    assert "teach train:" not in second and "features:" not in second and "train: step" not in second
    assert (work / "teach-train.json").read_text() == teach_state
    again = torch.load(work / "head.pt", weights_only=True)
    assert again["state"]["step"] == 2 and all(torch.equal(weights[k], again["model"][k]) for k in weights)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    # A larger step budget continues from the checkpoint.
    run(work, tmp_path / "more", target, steps=3)
    third = capsys.readouterr().out
    assert "train: step 3" in third and "train: step 1," not in third
    assert torch.load(work / "head.pt", weights_only=True)["state"]["step"] == 3


def test_the_features_stage_gives_transformers_states_within_float32s_bound(target):
    """The features stage runs the runtime's target: its captured states, final normed hidden and
    logits are a float32 forward's (within the bound of the float64 forward on the same weights,
    tests/bounds.py), and so are transformers' (its layers' inputs taken by hooks): the states are
    the capture layers' inputs in both. A row padded in a batch gets its own."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    exact = Float64Llama.from_transformers(hf)
    model = train_eagle3.load_target(target, [1, 2, 3])
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, 40).astype(np.int32)
    states, final_bound, logits_bound = exact.states(seq.tolist(), (1, 2, 3))
    (aux, final, argmax), (short_aux, short_final, _) = train_eagle3.features_of(model, [seq, seq[:12]])
    states.check(aux, "captured states")
    final_bound.check(final, "final normed hidden")
    logits_bound.check(model.logits(final), "logits")
    certain = certain_argmax(logits_bound)
    assert certain.sum() > 30 and torch.equal(argmax[certain], logits_bound.exact.argmax(-1)[certain])
    states[:12].check(short_aux, "a short row padded in a batch")
    final_bound[:12].check(short_final)

    inputs = {}
    hooks = [hf.model.layers[i].register_forward_pre_hook(
        lambda module, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0].clone()),
        with_kwargs=True) for i in (1, 2, 3)]
    with torch.no_grad():
        hf_out = hf(torch.from_numpy(seq.astype(np.int64))[None], output_hidden_states=True)
    for h in hooks:
        h.remove()
    states.check(torch.cat([inputs[i] for i in (1, 2, 3)], -1), "transformers' layer inputs")
    final_bound.check(hf_out.hidden_states[-1][0], "transformers' final hidden")


def tiny_head(seed=0, vocab=40, draft_vocab=16):
    cfg = Eagle3Config(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-5,
                       rope=RopeConfig(theta=10000.0), vocab_size=vocab, draft_vocab_size=draft_vocab,
                       target_hidden_size=32, feature_layers=(0, 1, 2))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, torch.randn(vocab, 32))
    head.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return head


def drafted_chain(head: Eagle3Head, aux, tokens, t: int, steps: int):
    """Inference written out for chain t: every verified position's step-0 entry in a KV cache,
    then one query at a time, each step appending its own key and feeding its output back."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    groups = attn.heads // attn.kv_heads

    def entry(hidden, token, pos):
        x = torch.cat([layer.input_layernorm(head.embed_tokens[token]), layer.hidden_norm(hidden)], -1)
        q = attn.q_proj(x).view(attn.heads, 1, attn.head_dim)
        k = attn.k_proj(x).view(attn.kv_heads, 1, attn.head_dim).repeat_interleave(groups, 0)
        v = attn.v_proj(x).view(attn.kv_heads, 1, attn.head_dim).repeat_interleave(groups, 0)
        p = torch.tensor([pos])
        return rope(q, p, head.inv_freq), rope(k, p, head.inv_freq), v

    keys, values = [], []
    fused = head.fc(aux)
    for s in range(t + 1):  # the verified positions: state of s with the token after it, at position s
        _, k, v = entry(fused[s], tokens[s + 1], s)
        keys.append(k)
        values.append(v)
    hidden, logits = fused[t], []
    for j in range(steps):
        q, k, v = entry(hidden, tokens[t + j + 1], t + j)
        if j > 0:
            keys.append(k)
            values.append(v)
        K, Vv = torch.cat(keys, 1), torch.cat(values, 1)
        out = ((q @ K.transpose(-1, -2)) * attn.head_dim ** -0.5).softmax(-1) @ Vv  # [heads, 1, d]
        residual = hidden + attn.o_proj(out.reshape(-1))
        hidden = residual + layer.mlp(layer.post_attention_layernorm(residual))
        logits.append(head.lm_head(head.norm(hidden)))
    return logits


def test_training_time_test_attends_as_a_drafted_chain_does():
    head = tiny_head()
    T, steps = 10, 3
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, T, 96, generator=g)
    tokens = torch.randint(0, 40, (1, T), generator=g)
    with torch.no_grad():
        unrolled = [head.logits(h) for h in head.ttt(aux, tokens, torch.ones(1, T, dtype=torch.bool), steps)]
        for t in (0, 3, T - steps - 1):
            chain = drafted_chain(head, aux[0], tokens[0], t, steps)
            for j in range(steps):
                assert torch.allclose(unrolled[j][0, t], chain[j], atol=1e-4), (t, j)


def test_padding_does_not_change_a_row():
    head = tiny_head(seed=2)
    g = torch.Generator().manual_seed(3)
    aux, tokens = torch.randn(2, 9, 96, generator=g), torch.randint(0, 40, (2, 9), generator=g)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    with torch.no_grad():
        both = head.ttt(aux, tokens, valid, 2)
        alone = head.ttt(aux[1:, :6], tokens[1:, :6], valid[1:, :6], 2)
    for j in range(2):  # chain t's step j reads tokens up to t + j + 1 < 6
        assert torch.allclose(both[j][1, : 5 - j], alone[j][0, : 5 - j], atol=1e-5)


def test_requests_cover_the_kinds_and_keep_the_benchmark_and_held_out_apart():
    requests = eagle3_requests.project_requests(600, seed=0)
    assert len(requests) == 600 and len({r["turns"][0] for r in requests}) == 600
    assert {r["kind"] for r in requests} == set(eagle3_requests.KINDS) and len(eagle3_requests.KINDS) == 12
    assert sum(len(r["turns"]) > 1 for r in requests) > 30
    bench = {eagle3_requests.normalized(t) for t in eagle3_requests.benchmark_prompts()}
    assert len(bench) >= 24
    # The recipe drops any request that is a benchmark prompt: plant one and see it go.
    planted = dict(kind="qa", turns=[next(iter(eagle3_requests.benchmark_prompts()))], source="project")
    kept = eagle3_requests.distinct_non_benchmark(requests + [planted, requests[0]])
    assert kept == requests  # the templates write no benchmark prompt either
    held = [r for r in requests if eagle3_requests.is_held_out(r["turns"][0], 0, 20)]
    assert 10 < len(held) < 60
    assert held == [r for r in eagle3_requests.project_requests(600, seed=0)
                    if eagle3_requests.is_held_out(r["turns"][0], 0, 20)]
    assert eagle3_requests.sane_request("Can you help me plan a three-day trip to Lisbon in spring?")
    assert not eagle3_requests.sane_request("the the the the the the the the the")
    assert not eagle3_requests.sane_request("<|im_start|>assistant")


def test_the_loss_of_step_j_is_against_the_targets_distribution_of_token_t_plus_j_plus_2():
    head = tiny_head(seed=4)
    g = torch.Generator().manual_seed(5)
    B, T, steps = 2, 8, 3
    aux, final = torch.randn(B, T, 96, generator=g), torch.randn(B, T, 32, generator=g)
    tokens = torch.randint(0, 40, (B, T), generator=g)
    lm_head = torch.randn(40, 32, generator=g)
    argmax = (final @ lm_head.T).argmax(-1)
    answer = torch.ones(B, T, dtype=torch.bool)
    answer[:, :2] = False
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 6:] = False
    batch = (aux, final, argmax, tokens, answer, valid)
    _, per_step = train_eagle3.ttt_loss(head, batch, lm_head[head.draft_ids], steps)
    with torch.no_grad():
        hiddens = head.ttt(aux, tokens, valid, steps)
    for j in range(steps):
        terms = []
        for b in range(B):
            for t in range(T):
                s = t + j + 2  # the token chain t's step j predicts
                if s < int(valid[b].sum()) and answer[b, s] and head.t2d[argmax[b, s - 1]]:
                    p = torch.softmax(final[b, s - 1] @ lm_head[head.draft_ids].T, -1)
                    terms.append(-(p * torch.log_softmax(head.logits(hiddens[j][b, t]), -1)).sum())
        assert terms and abs(per_step[j][0] - torch.stack(terms).mean().item()) < 1e-4, j


# ---- the recipe's head as the runtime drafts with it -------------------------------------------

def test_an_exported_head_drafts_as_the_recipe_trains_it(target, tmp_path):
    """A head made and exported by the recipe (random weights, rounded to bfloat16 as exported)
    loads with load_eagle3 under the same config, and over two rounds the runtime drafter's q for
    every draft step equals the recipe module's training-time-test logits of that chain (through
    d2t onto the target's ids): step 1 from the target's states of the verified tokens, steps 2..k
    from the fed-back hidden, attending to the verified pairs and the chain's earlier steps at
    their rope positions. Both are checked within float32's bound of the float64 head
    (tests/bounds.py), on the target's own captured features."""
    from safetensors.torch import load_file

    from specengine.drafters.eagle3 import Eagle3Drafter
    from specengine.models.eagle3 import load_eagle3
    from specengine.sampling.batch import SamplingBatch
    from specengine import SamplingParams

    model = train_eagle3.load_target(target, [1, 2, 3])
    V, G = model.config.vocab_size, 4
    draft_ids = sorted(np.random.default_rng(1).choice(V, 48, replace=False).tolist())
    embed = train_eagle3.dense_rows(model.model.embed_tokens, V)
    head = train_eagle3.make_head(model.config, [1, 2, 3], draft_ids, embed)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in head.named_parameters():  # weights that make the draws matter
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 if p.dim() == 2 else 0.5 + torch.rand(p.shape, generator=g))
    head = train_eagle3.bf16_rounded(head).eval()
    folder = eagle3_head.save_head(head, tmp_path / "head")

    runtime = load_eagle3(folder, model)
    assert runtime.config == head.config  # one config, written and read back
    assert Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()), 99) == head.config
    assert runtime.target_ids.tolist() == draft_ids
    exact = Float64Eagle3(load_file(folder / "model.safetensors"), embed, HEADS, KV_HEADS, HIDDEN // HEADS,
                          model.config.rms_norm_eps, head.inv_freq)

    drafter = Eagle3Drafter(runtime, V, V)
    greedy = SamplingBatch.from_params([SamplingParams(temperature=0)], [0], torch.device("cpu"))
    seq = np.random.default_rng(3).integers(0, V, 20).tolist()
    drafter.join_rows([seq], 64)
    drafter.take_features([0], [0], _features(model, seq)[None, :len(seq) - 1], [len(seq) - 1])
    for rnd in range(2):
        if rnd == 1:  # verification kept draft 1 and emitted another token: the target's states of both
            seq = seq + [drafts[0], 5]
            drafter.take_features([0], [len(seq) - 3], _features(model, seq)[None, len(seq) - 3:len(seq) - 1], [2])
        proposal = drafter.propose([seq], [G], greedy)
        drafts, q = proposal.tokens[0].tolist(), proposal.logits[0]  # [G], [G, V]
        assert torch.isinf(q[:, [i for i in range(V) if i not in draft_ids]]).all()
        n = len(seq)
        chain = seq + drafts[:-1]  # the chain's steps read the drafted tokens (teacher-forced in training)
        aux = torch.zeros(1, len(chain), 3 * HIDDEN)
        aux[0, :n - 1] = _features(model, seq)[:n - 1]
        with torch.no_grad():
            hiddens = head.ttt(aux, torch.tensor([chain]), torch.ones(1, len(chain), dtype=torch.bool), G)
        trained = torch.stack([head.logits(h[0, n - 2]) for h in hiddens])  # [G, Vd]: chain n - 2
        bound = exact.chain_logits(_features(model, seq)[:n - 1], seq[1:], drafts[:-1])
        bound.check(q[:, draft_ids], f"round {rnd + 1}: the runtime drafter's q")
        bound.check(trained, f"round {rnd + 1}: the recipe's training-time test")


def _features(model, seq: list[int]) -> torch.Tensor:
    """The target's captured states [len(seq), F] of a sequence (the features stage's)."""
    return train_eagle3.features_of(model, [np.array(seq, dtype=np.int32)])[0][0]
