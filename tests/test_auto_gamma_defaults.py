"""gamma="auto" as the default: what it costs a first request (the step costs of a batch size are
measured when a batch first needs them, a few verification widths timed, and kept per machine
for the next process), and a draft whose every proposal fails: its request stops drafting and
probes ever more rarely."""
import json
import os
import time

import pytest
import torch

from specengine import Engine, SamplingParams
from specengine.cli import build_parser
from specengine.drafters.model import ModelDrafter
from specengine.engine import engine as engine_module
from specengine.engine.config import EngineConfig
from specengine.engine.costs import CostStore, OtherLoad, timed_widths
from specengine.engine.gamma import CostModel, CostTable, GammaController

from engine_util import tiny_model

V = 48
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def draft_for(seed: int = 1):
    return ModelDrafter(tiny_model(V, seed=seed, num_layers=1, hidden_size=16), V, V)


def test_auto_is_the_default_gamma_of_the_engine_and_the_command_line():
    assert EngineConfig().gamma == "auto"
    engine = Engine(tiny_model(V), drafter=draft_for())
    assert engine.auto_gamma and engine.gamma == EngineConfig().max_gamma
    plain = Engine(tiny_model(V))
    assert not plain.auto_gamma and plain.gamma == 0 and plain.gamma_controller is None
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).gamma == "auto"
    assert parser.parse_args(["serve"]).gamma == "auto"
    assert parser.parse_args(["generate", "--prompt", "x", "--gamma", "3"]).gamma == 3


def test_a_draft_whose_every_proposal_fails_stops_drafting_and_probes_ever_more_rarely(monkeypatch):
    """The draft is the target with its output layer negated: greedy, it proposes the token the
    target ranks last, and every proposal is rejected. After its first rounds the request decodes
    at gamma 0, target-only, drafting one token now and then (a probe), each probe after a wait
    twice the one before, up to 2^MAX_BACKOFF times the first; the tokens are the target's own.
    (The first wait is PROBE_EVERY rounds or more: probe_interval spaces probes by their cost.
    MAX_BACKOFF is 2 here: the same back-off in fewer rounds.)"""
    monkeypatch.setattr(GammaController, "MAX_BACKOFF", 2)
    target = tiny_model(V, seed=0, logit_scale=3.0, max_positions=512)
    contrary = tiny_model(V, seed=0, logit_scale=-3.0, max_positions=512)
    costs = CostModel(0.2, tuple(1.0 + 0.1 * k for k in range(9)))  # drafting pays from alpha ~0.3
    engine = Engine(target, drafter=ModelDrafter(contrary, V, V), costs=costs)  # the default gamma
    gammas = []
    real = engine.runner.rounds.run
    monkeypatch.setattr(engine.runner.rounds, "run",
                        lambda batch, gamma, rounds: (gammas.append(gamma), real(batch, gamma, rounds))[1])
    params = SamplingParams(max_new_tokens=400, temperature=0)
    (result,) = engine.generate([[1, 2, 3]], params)
    assert result.token_ids == Engine(target).generate([[1, 2, 3]], params)[0].token_ids
    assert result.stats.drafted > 0 and result.stats.accepted == 0

    first_rest = gammas.index(0)
    assert first_rest <= 6  # a few rounds of rejections bring its alpha down
    probes = [i for i, g in enumerate(gammas) if g and i > first_rest]
    assert all(gammas[i] == 1 for i in probes)  # one draft each, and back to gamma 0 after it
    assert all(gammas[i + 1] == 0 for i in probes if i + 1 < len(gammas))
    waits = [b - a - 1 for a, b in zip([first_rest - 1] + probes, probes)]  # rounds at gamma 0 before each
    assert waits[0] >= GammaController.PROBE_EVERY and len(waits) >= GammaController.MAX_BACKOFF + 2
    growth = [b / a for a, b in zip(waits, waits[1:])]
    backoff = GammaController.MAX_BACKOFF
    assert all(1.9 < g < 2.2 for g in growth[:backoff])  # every wait twice the last ...
    assert all(0.9 < g < 1.1 for g in growth[backoff:])  # ... up to 2^MAX_BACKOFF times the first
    assert sum(g > 0 for g in gammas) < 0.03 * len(gammas)


def spy_measurements(monkeypatch, engine: Engine) -> list:
    """Events in order: ("measure", batch size, widths) for each measurement, ("round", rows)."""
    events = []
    real_measure = engine_module.measure_costs

    def measure(*args, batch_size, widths, **kwargs):
        events.append(("measure", batch_size, widths))
        return real_measure(*args, batch_size=batch_size, widths=widths, **kwargs)

    monkeypatch.setattr(engine_module, "measure_costs", measure)
    real_run = engine.runner.rounds.run
    monkeypatch.setattr(engine.runner.rounds, "run",
                        lambda batch, gamma, rounds: (events.append(("round", len(batch))), real_run(batch, gamma, rounds))[1])
    return events


def test_the_larger_batch_size_is_measured_when_a_batch_first_needs_it(monkeypatch):
    """A request decoding alone needs batch 1's costs only: the batch of 8's, most of the time
    measuring took, are measured when a second request joins, before the round that has it (not
    in it, whose timing would teach the controller a measurement as its round overhead). On the
    eager path a few widths are timed."""
    engine = Engine(tiny_model(V), drafter=draft_for(), max_gamma=3)
    events = spy_measurements(monkeypatch, engine)
    table = engine.gamma_controller.costs_by_batch
    assert isinstance(table, CostTable) and table.batch_sizes == (1, 8) and table.measured == ()
    engine.generate([[1, 2, 3]], GREEDY)
    assert [e for e in events if e[0] == "measure"] == [("measure", 1, timed_widths(3))] and table.measured == (1,)
    events.clear()
    engine.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY)
    assert events[0] == ("measure", 8, timed_widths(3)) and all(e[0] == "round" for e in events[1:])
    assert table.measured == (1, 8) and set(table.seconds) == {1, 8}
    # an engine that decodes one request at a time plans batch 1 only
    single = Engine(tiny_model(V), drafter=draft_for(), max_batch_size=1)
    assert single.gamma_controller.costs_by_batch.batch_sizes == (1,)


def test_cost_table_measures_each_size_once_and_checks_what_it_gets():
    measured = []

    def measure(batch_size):
        measured.append(batch_size)
        return CostModel(0.001 * batch_size, (0.01 * batch_size,) * 4)

    table = CostTable(3, [1, 4, 8], measure)
    assert list(table) == [1, 4, 8] and len(table) == 3 and measured == []
    table.cover(2)  # a batch of 2 is priced between batch 1's costs and batch 4's
    assert measured == [1, 4] and table.measured == (1, 4)
    assert table[4].draft_step_s == 0.004 and measured == [1, 4]
    controller = GammaController(table)
    assert controller.max_gamma == 3 and controller.costs_for(6).draft_step_s == pytest.approx(0.006)
    assert measured == [1, 4, 8]
    with pytest.raises(KeyError):
        table[2]
    with pytest.raises(ValueError, match="cover the same gammas"):
        CostTable(2, [1], lambda b: CostModel(0.0, (1.0,) * 4))[1]
    with pytest.raises(ValueError, match="needs the costs of every batch size"):
        CostTable(3, [1, 8], given={1: CostModel(0.0, (1.0,) * 4)})
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        CostTable(3, [0], measure)


COSTS = CostModel(0.0009, (0.0100, 0.0127, 0.0140, 0.0170, 0.0237))
KEY = {"format": CostStore.FORMAT, "models": {"target": [["/models/t.gguf", 100, 7]]}, "max_gamma": 4}


def test_stored_costs_are_read_back_by_the_next_store_of_the_same_key(tmp_path):
    store = CostStore(KEY, tmp_path)
    assert store.load(1) is None  # no file yet
    store.save(1, COSTS, seconds=0.4)
    store.save(8, CostModel(0.002, (0.03,) * 5), seconds=1.5)
    again = CostStore(dict(KEY), tmp_path)
    assert again.path == store.path and again.load(1) == COSTS and again.load(8).verify_s == (0.03,) * 5
    assert again.load(2) is None
    entries = json.loads(store.path.read_text())["costs"]
    assert entries["1"]["measure_s"] == 0.4 and list(tmp_path.iterdir()) == [store.path]  # no temporary left
    other = CostStore(dict(KEY, max_gamma=8), tmp_path)  # another key: another file
    assert other.path != store.path and other.load(1) is None


def test_quick_measurements_and_those_of_a_busy_machine_are_not_kept(tmp_path):
    store = CostStore(KEY, tmp_path)
    store.save(1, COSTS, seconds=CostStore.STORE_AFTER_S / 2)
    assert not store.path.exists()
    store.save(1, COSTS, seconds=1.0, other_load=CostStore.MAX_OTHER_LOAD + 0.5)  # others kept a core busy
    assert not store.path.exists()
    store.save(1, COSTS, seconds=1.0, other_load=None)  # a machine without /proc/stat
    assert store.load(1) == COSTS


def test_other_load_counts_other_processes_not_this_one():
    load = OtherLoad()
    x = 0
    for i in range(200_000):  # this process busy
        x += i
    cores = load.cores()
    assert cores is None or 0.0 <= cores <= os.cpu_count()


def test_other_load_never_exceeds_the_machines_cores(monkeypatch):
    """Ticks counted over a few milliseconds can add up to more busy time than wall time allows."""
    cores = os.cpu_count()
    readings = iter([(0.0, 100.0, 1.0), (0.01, 100.0 + 0.03 * cores, 1.0)])  # 3x the cores' worth in 10 ms
    monkeypatch.setattr(OtherLoad, "_ticks", staticmethod(lambda: next(readings)))
    assert OtherLoad().cores() == cores


@pytest.mark.parametrize("content", [
    "{", "", "[]", "null", '{"key": 3}', '{"costs": {}}',
    json.dumps({"key": KEY, "costs": []}),
    json.dumps({"key": KEY, "costs": {"1": "fast"}}),
    json.dumps({"key": KEY, "costs": {"1": {"draft_step_s": 0.001, "verify_s": [0.01] * 3, "measured_at": 0}}}),
    json.dumps({"key": KEY, "costs": {"1": {"draft_step_s": 0.001, "verify_s": [0.01, -1, 0.01, 0.01, 0.01],
                                            "measured_at": "now"}}}),
    json.dumps({"key": KEY, "costs": {"1": {"draft_step_s": "NaN", "verify_s": [0.01] * 5, "measured_at": 1}}}),
    json.dumps({"key": KEY, "costs": {"1": {"verify_s": [0.01] * 5}}}),
])
def test_a_corrupt_or_foreign_file_is_ignored_and_replaced(tmp_path, content):
    store = CostStore(KEY, tmp_path)
    store.path.write_text(content)
    assert store.load(1) is None
    store.save(1, COSTS, seconds=1.0)
    assert CostStore(KEY, tmp_path).load(1) == COSTS


def test_a_file_of_another_key_under_the_same_name_is_not_used(tmp_path):
    store = CostStore(KEY, tmp_path)
    CostStore(dict(KEY, max_gamma=8), tmp_path).save(1, CostModel(0.001, (0.01,) * 9), seconds=1.0)
    os.replace(CostStore(dict(KEY, max_gamma=8), tmp_path).path, store.path)
    assert store.load(1) is None
    store.save(1, COSTS, seconds=1.0)  # and it is replaced by this key's
    assert store.load(1) == COSTS and json.loads(store.path.read_text())["key"] == store.key


def test_stale_costs_are_measured_again(tmp_path, monkeypatch):
    store = CostStore(KEY, tmp_path)
    store.save(1, COSTS, seconds=1.0)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + CostStore.MAX_AGE_S + 60)
    assert store.load(1) is None
    monkeypatch.setattr(time, "time", lambda: now - 3600)  # measured in the future: a clock that jumped
    assert store.load(1) is None


def test_a_cache_folder_that_cannot_be_written_is_skipped(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = CostStore(KEY, blocked / "costs")
    store.save(1, COSTS, seconds=1.0)  # no error
    assert store.load(1) is None


def test_the_key_follows_the_model_files_and_the_machine(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x" * 10)
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    sources = dict(target=model, draft=folder, drafter="model", dtype=None, weight_dtype=None)

    def store(**changes):
        return CostStore.for_models(dict(sources, **changes), 8, torch.device("cpu"), False, tmp_path)

    first = store()
    assert first.path == store().path
    machine = first.key["machine"]
    assert machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__
    assert [f[0] for f in first.key["models"]["draft"]] == [str((folder / "config.json").resolve())]
    assert store(dtype="bfloat16").path != first.path
    assert CostStore.for_models(sources, 4, torch.device("cpu"), False, tmp_path).path != first.path
    assert CostStore.for_models(sources, 8, torch.device("cpu"), True, tmp_path).path != first.path
    os.utime(model, ns=(1, 1))  # the file changed
    changed = store()
    assert changed.path != first.path
    (folder / "model.safetensors").write_bytes(b"")  # a file more in the draft's folder
    assert store().path != changed.path
    assert store(target=tmp_path / "gone.gguf") is None  # files that cannot be read again: nothing kept


def test_from_pretrained_keeps_measured_costs_for_the_next_engine(text_pair, tmp_path, monkeypatch):
    """The first engine of a pair measures its costs and keeps them under $SPECENGINE_CACHE; the
    next one (another process, as far as it knows) reads them; a corrupt file is measured again."""
    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(CostStore, "STORE_AFTER_S", 0.0)  # tiny models measure in milliseconds
    monkeypatch.setattr(CostStore, "MAX_OTHER_LOAD", float("inf"))  # whatever else runs meanwhile
    first = Engine.from_pretrained(*text_pair, max_gamma=3)
    first.generate(["a = "], GREEDY)
    (path,) = (tmp_path / "costs").iterdir()
    assert set(json.loads(path.read_text())["costs"]) == {"1"}
    measured = first.gamma_controller.costs_by_batch[1]

    second = Engine.from_pretrained(*text_pair, max_gamma=3)
    events = spy_measurements(monkeypatch, second)
    (result,) = second.generate(["a = "], GREEDY)
    assert not [e for e in events if e[0] == "measure"] and second.gamma_controller.costs_by_batch[1] == measured
    assert result.token_ids == Engine.from_pretrained(text_pair[0]).generate(["a = "], GREEDY)[0].token_ids

    path.write_text("{ not json")
    third = Engine.from_pretrained(*text_pair, max_gamma=3)
    events = spy_measurements(monkeypatch, third)
    third.generate(["a = "], GREEDY)
    assert [e[:2] for e in events if e[0] == "measure"] == [("measure", 1)]
    assert set(json.loads(path.read_text())["costs"]) == {"1"}

    # without the models' files (an Engine made of models in memory) nothing is kept
    drafter = ModelDrafter(first.drafter.model, first.target.config.vocab_size, len(first.tokenizer))
    Engine(first.target, first.tokenizer, drafter, max_gamma=3).generate(["a = "], GREEDY)
    assert list((tmp_path / "costs").iterdir()) == [path]
