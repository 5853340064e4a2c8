"""The suffix drafter (suffix decoding): its trees (counts and structure against brute force,
removal oldest first), its drafts from a row's own tokens and from earlier outputs, the global
tree's budget (an option of Engine.from_pretrained, the command line and serve), nothing proposed
where nothing matches; in the engine: greedy output identical to target-only (fixed gamma,
gamma="auto", batches with joins and aborts, T5), the exact sampling distribution, and a recurring
request drafted from the first one's output."""
import random

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.drafters.suffix import SuffixDrafter, SuffixTree
from specengine.engine.gamma import CostModel

from engine_util import greedy_fixtures, tiny_model

V = 32
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
target, baseline = greedy_fixtures(V, PROMPTS, GREEDY)
SAMPLING = type("Sampling", (), {"seeds": torch.zeros(1, dtype=torch.int64)})()  # propose() reads its device
# gamma="auto" costs: a free drafter, verification a little dearer per token.
COSTS = {b: CostModel(0.0, tuple(1.0 + 0.05 * k for k in range(5))) for b in (1, 8)}


def check_tree(tree: SuffixTree):
    """Every node against brute force: its tokens are those of its reference, its count the
    occurrences of its path in the documents (suffixes of at most max_depth tokens), keyed by its
    first token under its parent; a node with one child and its count is merged into it."""
    occurrences = {}
    for seq in tree.docs.values():
        for i in range(len(seq)):
            for n in range(1, min(tree.max_depth, len(seq) - i) + 1):
                key = tuple(seq[i:i + n])
                occurrences[key] = occurrences.get(key, 0) + 1
    assert tree.root.count == sum(len(s) for s in tree.docs.values())
    seen = 0
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (node.children or {}).items():
            assert child.parent is node and child.length > 0 and child.count > 0
            assert node is tree.root or child.count < node.count  # else the two are one run
            ref = tree.docs[child.doc][child.start:child.start + child.length]
            assert len(ref) == child.length and ref[0] == token
            full = path + tuple(ref)
            assert len(full) <= tree.max_depth
            for n in range(len(path) + 1, len(full) + 1):  # within a run every prefix counts alike
                assert occurrences[full[:n]] == child.count, (full[:n], child.count)
            seen += child.length
            stack.append((child, full))
    assert seen == len(occurrences)  # every distinct substring is on exactly one node


def propose(drafter, sequences, budget=8):
    proposal = drafter.propose(sequences, [budget] * len(sequences), SAMPLING)
    assert proposal.logits is None and proposal.draft_calls == 0
    return [proposal.tokens[b, :n].tolist() for b, n in enumerate(proposal.num_drafts.tolist())]


# ---- the tree


@pytest.mark.parametrize("seed", range(6))
def test_tree_counts_match_brute_force_through_appends_and_removals(seed):
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=rng.choice([2, 3, 5, 8]))
    alive = []
    for doc in range(12):
        vocab = rng.choice([2, 3, 6])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.3 and alive:  # a repeat of an earlier document, as recurring outputs are
            tokens = list(tree.docs[rng.choice(alive)])
        for k in range(0, len(tokens), 7):  # grown a round at a time
            tree.extend(doc, tokens[k:k + 7])
            check_tree(tree)
        tree.close(doc)
        alive.append(doc)
        while len(alive) > 4 or (alive and rng.random() < 0.2):
            tree.remove(alive.pop(0))  # oldest first
            check_tree(tree)
    for doc in list(alive):
        tree.remove(doc)
    check_tree(tree)
    assert len(tree) == 0 and not tree.root.children


def test_longest_match_and_walk():
    tree = SuffixTree(max_depth=6)
    tree.extend(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    tree.extend(1, [1, 2, 3, 4, 0])
    node, idx, length = tree.longest_match([9, 9, 2, 3, 4], 5)
    assert length == 3
    # 5 in one of the two occurrences (1/2), to max_depth; then the text after that occurrence
    assert tree.walk(node, idx, 8, 0.1) == ([5, 6, 7, 8, 9], 2.5)
    assert tree.walk(node, idx, 8, 0.6) == ([], 0.0)  # below min_prob at once
    assert tree.longest_match([42], 5) is None
    assert tree.longest_match([9, 9, 2, 3, 4], 2)[2] == 2


# ---- drafts


def test_drafts_from_the_rows_own_tokens():
    drafter = SuffixDrafter()
    drafter.join_rows([[1, 2, 3, 4, 5, 9]], 64)
    # The repeated suffix 1 2 3 (three tokens) earns at most three drafts.
    assert propose(drafter, [[1, 2, 3, 4, 5, 9, 1, 2, 3]]) == [[4, 5, 9]]
    assert propose(drafter, [[1, 2, 3, 4, 5, 9, 1, 2, 3]], budget=2) == [[4, 5]]
    # Four more tokens, a longer match, a longer draft.
    assert propose(drafter, [[1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1]]) == [[2, 3, 4, 5, 9, 1]]


def test_draft_length_follows_the_counts():
    """After 7 1 came 2, 3 and 2: 2 is drafted (2/3); what followed 7 1 2 splits (1/2 each), so with
    min_prob 0.5 the draft stops after one token, with 0.1 it goes on."""
    seq = [7, 1, 2, 7, 1, 3, 7, 1, 2, 8, 7, 1]
    for min_prob, want in ((0.5, 1), (0.1, 2)):
        drafter = SuffixDrafter(min_prob=min_prob)
        drafter.join_rows([seq], 64)
        (draft,) = propose(drafter, [seq])
        assert draft[0] == 2 and len(draft) == want


def test_nothing_matches_nothing_proposed():
    drafter = SuffixDrafter()
    drafter.join_rows([[1, 2, 3, 4], [5, 6, 5]], 64)
    proposal = drafter.propose([[1, 2, 3, 4], [5, 6, 5]], [4, 4], SAMPLING)
    assert proposal.num_drafts.tolist() == [0, 1] and proposal.tokens[1, 0] == 6
    proposal = drafter.propose([[1, 2, 3, 4], [5, 6, 7]], [4, 4], SAMPLING)
    assert proposal.num_drafts.tolist() == [0, 0] and proposal.tokens.shape == (2, 0)
    # A budget of 0 drafts nothing and indexes nothing.
    drafter.join_rows([[9, 9, 9]], 64)
    assert drafter.propose([[1, 2, 3, 4], [5, 6, 7], [9, 9, 9]], [0, 0, 0], SAMPLING).tokens.shape == (3, 0)
    assert drafter.rows[2].indexed == 0


def test_drafts_from_finished_requests_outputs():
    drafter = SuffixDrafter()
    drafter.join_rows([[1, 2]], 64)
    propose(drafter, [[1, 2, 10, 11, 12, 13, 14]])
    drafter.keep_rows([])  # the request left: its output (after its prompt's end) is learned
    assert drafter.global_tokens == 7 and drafter.rows == []
    drafter.join_rows([[5, 1, 2], [1, 2, 10, 11]], 64)
    # A match of two tokens drafts two; of four, the rest of that output.
    assert propose(drafter, [[5, 1, 2], [1, 2, 10, 11]]) == [[10, 11], [12, 13, 14]]
    # The row's own tokens win where they match longer.
    drafter.join_rows([[3, 4, 5, 6, 3, 4, 5, 1, 2, 10, 20, 3, 4, 5, 1, 2, 10]], 64)
    assert propose(drafter, [[5, 1, 2], [1, 2, 10, 11], drafter.rows[2].prompt])[2] == [20, 3, 4, 5, 1, 2]


def test_global_budget_drops_the_oldest_outputs():
    drafter = SuffixDrafter(max_global_tokens=10)
    outputs = [[20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]]
    for out in outputs:
        drafter.join_rows([[1]], 64)
        propose(drafter, [[1] + out])
        drafter.keep_rows([])
    assert drafter.global_tokens == 10  # [1, 30, ...] and [1, 40, ...]: the first left
    check_tree(drafter.global_tree)
    drafter.join_rows([[20, 21], [30, 31], [40, 41]], 64)
    assert propose(drafter, [[20, 21], [30, 31], [40, 41]]) == [[], [32, 33], [42, 43]]
    # An output longer than the whole budget keeps its end.
    drafter.learn(range(100, 130))
    assert drafter.global_tokens == 10 and list(drafter.global_tree.docs.values()) == [list(range(120, 130))]
    check_tree(drafter.global_tree)
    none = SuffixDrafter(max_global_tokens=0)
    none.join_rows([[1]], 64)
    propose(none, [[1, 2, 3]])
    none.keep_rows([])
    assert none.global_tokens == 0


def test_rows_follow_keep_rows():
    drafter = SuffixDrafter()
    drafter.join_rows([[1, 2, 1], [3, 4, 3], [5, 6, 5]], 64)
    assert propose(drafter, [[1, 2, 1], [3, 4, 3], [5, 6, 5]]) == [[2], [4], [6]]
    drafter.keep_rows([2, 0])  # the middle request left; its output (none) teaches nothing
    drafter.join_rows([[7, 8, 7]], 64)
    assert propose(drafter, [[5, 6, 5, 6, 5], [1, 2, 1, 2], [7, 8, 7]]) == [[6, 5], [1, 2], [8]]
    with pytest.raises(RuntimeError, match="3 rows"):
        propose(drafter, [[1]])


def test_drafts_from_the_encoder_input():
    drafter = SuffixDrafter()
    drafter.join_rows([[0], [0]], 16, sources=[[7, 8, 9, 10, 11, 1], [5, 5, 6]])
    assert propose(drafter, [[0, 8, 9], [0, 2]], budget=3) == [[10, 11], []]


# ---- in the engine


@pytest.mark.parametrize("gamma, options", [
    (1, {}), (3, {}), (8, {}),
    (3, dict(cuda_graphs=True, max_batch_size=3)),  # fixed-shape steps (eager on a CPU); later rows wait
    (3, dict(cuda_graphs=True, max_batch_size=4, rounds_per_read=4)),  # host rounds between blocks
])
def test_greedy_equals_target_only(target, baseline, gamma, options):
    engine = Engine(target, drafter=SuffixDrafter(), gamma=gamma, **options)
    for _ in range(2):  # the second run drafts from the first's outputs too
        assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == baseline
        stats = engine.last_run_stats
        assert stats.draft_calls == 0 and sum(stats.accepted_histogram) == stats.rounds
    assert stats.accepted > 0


def test_greedy_with_auto_gamma_equals_target_only(target, baseline):
    engine = Engine(target, drafter=SuffixDrafter(), gamma="auto", max_gamma=4, costs=COSTS)
    for _ in range(2):
        assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == baseline
    assert engine.last_run_stats.accepted > 0


def test_a_recurring_request_drafts_from_the_first_ones_output(target):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_new_tokens=64, temperature=0)
    engine = Engine(target, drafter=SuffixDrafter(), gamma=4)
    (first,) = engine.generate([prompt], params)
    (second,) = engine.generate([prompt], params)
    assert second.token_ids == first.token_ids
    # The first drafts from its own tokens only (this model soon repeats itself); the second,
    # from the first's output, from its first round on: nearly every round emits gamma + 1 tokens.
    assert second.stats.acceptance_rate > 0.9
    assert second.stats.rounds <= 64 // 5 + 2 < first.stats.rounds


def test_joins_and_aborts(target):
    """Requests join at different steps and one is aborted: greedy ones get their target-only
    tokens, the aborted one a prefix of them, sampled ones their length; the drafter's rows follow
    the batch's, and the finished outputs are learned."""
    drafter = SuffixDrafter()
    engine = Engine(target, drafter=drafter, gamma=3)
    greedy = SamplingParams(max_new_tokens=20, temperature=0)
    sampled = SamplingParams(max_new_tokens=15, temperature=1.0, seed=7, ignore_eos=True)
    want = {i: Engine(target).generate([PROMPTS[i]], greedy)[0].token_ids for i in range(4)}
    arrivals = {0: [("g0", 0, greedy), ("s1", 1, sampled)], 1: [("g1", 1, greedy)], 2: [("a2", 2, greedy)],
                4: [("g3", 3, greedy), ("g0b", 0, greedy)]}
    outputs = {}
    step = 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals) or engine.has_pending_outputs():
        for request_id, prompt, p in arrivals.get(step, []):
            engine.add_request(PROMPTS[prompt], p, request_id)
        if step == 3:
            assert engine.abort("a2")
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(drafter.rows) == engine.num_running
        step += 1
    assert outputs["g0"] == outputs["g0b"] == want[0]
    assert outputs["g1"] == want[1] and outputs["g3"] == want[3]
    assert outputs["a2"] == want[2][:len(outputs["a2"])]
    assert len(outputs["s1"]) == 15
    assert drafter.rows == [] and drafter.global_tokens > 0


def test_t5_greedy_equals_target_only(tmp_path, tokenizer):
    from specengine.devtools.tiny import make_t5_config, save_random_t5_checkpoint

    config = make_t5_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, feed_forward_proj="relu",
                            tie_word_embeddings=True, relative_attention_num_buckets=8,
                            relative_attention_max_distance=12)
    save_random_t5_checkpoint(tmp_path, config, tokenizer, seed=0, init_scale=2.0)
    prompts = ["def add(a, b):\n    return a + b", "import os", "def add(a, b):\n    return a + b"]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    want = [r.token_ids for r in Engine.from_pretrained(tmp_path).generate(prompts, params)]
    engine = Engine.from_pretrained(tmp_path, drafter="suffix", gamma=3)
    assert isinstance(engine.drafter, SuffixDrafter)
    for _ in range(2):
        assert [r.token_ids for r in engine.generate(prompts, params)] == want


def test_suffix_drafter_takes_no_draft_model_and_is_a_cli_choice():
    from specengine.cli import build_parser

    with pytest.raises(ValueError, match="suffix drafter takes no draft model"):
        Engine.from_pretrained("target-folder", "draft-folder", drafter="suffix")
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args([*command, "--drafter", "suffix"]).drafter == "suffix"


def test_cli_generates_with_the_suffix_drafter(text_pair, capsys):
    import json

    from specengine.cli import main

    target, _ = text_pair
    args = ["generate", "--target", str(target), "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens",
            "8", "--gamma", "3", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, "--drafter", "suffix"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want and out["stats"]["draft_calls"] == 0


def test_the_global_budget_is_an_option_of_from_pretrained(text_pair):
    target, _ = text_pair
    assert Engine.from_pretrained(target, drafter="suffix").drafter.max_global_tokens == 1 << 18  # the default
    engine = Engine.from_pretrained(target, drafter="suffix", suffix_max_global_tokens=0, gamma=3)
    assert engine.drafter.max_global_tokens == 0
    engine.generate(["def f(x):", "class A:"], GREEDY)
    assert len(engine.drafter.global_tree) == 0  # no outputs kept: no global tree
    engine = Engine.from_pretrained(target, drafter="suffix", suffix_max_global_tokens=10, gamma=3)
    engine.generate(["def f(x):", "class A:"], GREEDY)
    assert 0 < len(engine.drafter.global_tree) <= 10
    # Refused before anything loads (no such folder).
    with pytest.raises(ValueError, match="suffix_max_global_tokens is an option of drafter='suffix', not 'ngram'"):
        Engine.from_pretrained("target-folder", drafter="ngram", suffix_max_global_tokens=5)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=rf"suffix_max_global_tokens must be an integer >= 0 .*got {bad!r}"):
            Engine.from_pretrained("target-folder", drafter="suffix", suffix_max_global_tokens=bad)


def test_the_global_budget_is_a_cli_option(text_pair, capsys):
    import json

    from specengine.cli import build_parser, main

    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args(command).suffix_max_global_tokens is None
        assert build_parser().parse_args([*command, "--suffix-max-global-tokens", "5"]).suffix_max_global_tokens == 5
    target, _ = text_pair
    args = ["generate", "--target", str(target), "--prompt", "def f(x):", "--temperature", "0", "--max-new-tokens",
            "8", "--gamma", "3", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, "--drafter", "suffix", "--suffix-max-global-tokens", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    for extra, message in ((["--suffix-max-global-tokens", "5"], "--suffix-max-global-tokens is an option of "
                                                                 "--drafter suffix, not model"),
                           (["--drafter", "suffix", "--suffix-max-global-tokens", "-1"],
                            "--suffix-max-global-tokens must be >= 0, got -1")):
        assert main([*args, *extra]) == 2
        assert capsys.readouterr().err == f"specengine: error: {message}\n"


def test_serve_passes_the_global_budget_and_refuses_it_without_the_suffix_drafter(text_pair, capsys, monkeypatch):
    from specengine.cli import main
    from server_util import free_port

    loads = []

    def no_load(*args, **kwargs):
        loads.append(kwargs)
        raise ValueError("not loaded in this test")

    monkeypatch.setattr(Engine, "from_pretrained", no_load)
    serve = ["serve", "--target", str(text_pair[0]), "--port", str(free_port()), "--suffix-max-global-tokens", "7"]
    assert main(serve) == 2 and not loads  # refused before loading
    assert capsys.readouterr().err.startswith("specengine: error: --suffix-max-global-tokens is an option of "
                                              "--drafter suffix, not model\n")
    assert main([*serve, "--drafter", "suffix"]) == 2
    assert [(kw["drafter"], kw["suffix_max_global_tokens"]) for kw in loads] == [("suffix", 7)]


@pytest.mark.slow
def test_sampling_matches_exact_target_distribution():
    """The exact distribution over 3-token continuations (test_engine_sampling's check), with
    requests run 500 at a time so that later ones draft from earlier ones' outputs."""
    from stats_util import CASES, NEW, PROMPT, V as SV, chi_square_pvalue, continuation_counts, exact_distribution

    target = tiny_model(SV, seed=0, hidden_size=16, logit_scale=4.0)
    for case in ("T=1", "T=0.7,top_k=3"):
        params = CASES[case]
        engine = Engine(target, drafter=SuffixDrafter(), gamma=3)
        counts = torch.zeros(SV ** NEW, dtype=torch.int64)
        drafted = accepted = 0
        for chunk in range(24):
            requests = [SamplingParams(max_new_tokens=NEW, temperature=params.temperature, top_k=params.top_k,
                                       top_p=params.top_p, min_p=params.min_p, seed=chunk * 500 + s)
                        for s in range(500)]
            counts += continuation_counts(engine.generate([PROMPT] * 500, requests))
            drafted += engine.last_run_stats.drafted
            accepted += engine.last_run_stats.accepted
        assert chi_square_pvalue(counts, exact_distribution(target, params)) > 1e-3
        assert 0 < accepted < drafted  # drafts were tested, and some rejected
