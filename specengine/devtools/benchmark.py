"""`specengine bench`: end-to-end decoding speed of specengine against Hugging Face and eager PyTorch.

Every configuration runs in one process after a warm-up; the repeats are interleaved
(configuration after configuration, repeat after repeat) and the median is reported:
  - transformers `generate` on the target alone, and with `assistant_model=` the draft
    (assisted generation cannot batch: batch 1 only, said so in the table);
  - an eager PyTorch loop over our model and its KV cache (the design's baseline);
  - specengine target-only, with the draft model (or an EAGLE-3 head: drafter "eagle3", a head
    folder as the draft, no HF assisted rows) at each fixed gamma and gamma="auto", and with the
    n-gram (prompt lookup) drafter;
  - llama.cpp (llama-cpp-python, when installed and the target's GGUF file is known) at batch 1:
    target-only on the same weights in bfloat16 (what specengine holds them in), and its own
    speculative decoding (prompt lookup, the one its Python API has). Not on the quantized file
    itself: on this project's CPU (AVX-512 with AMX) llama.cpp 0.3.36's repacked Q4_1 weights
    crashed and without repacking ran far slower (bench/results/e2e-2026-12-01.md).
Prompts: for a target with a chat template, held-out chat requests (specengine.devtools.corpus,
a split no shipped model trained on) through the template; else code cut from the pycode pair's
held-out files. Per configuration: tokens/s, ratios to HF and HF assisted, alpha (overall and by draft
position), tokens per target call, c, the speedup over specengine target-only (the paper's
baseline) next to Theorem 3.8's prediction,
the extra arithmetic (the paper's Table 1 "ops"), where a round's time goes, and whether greedy
outputs equal HF's greedy outputs. Writes <label>-<date>.csv (label "e2e" unless given) and, with
matplotlib, <label>-<date>.png:
measured and predicted speedup against gamma (the paper's Figure 3) and the accepted-length
histogram.

run_benchmark is four stages over typed keys (Key: kind, temperature, batch, gamma, drafter; a
configuration's name is only how the tables print it): plan (the configurations the options ask
for), run (load the models, warm up, measure step costs, the interleaved repeats), derive (each
configuration's CSV row from its runs and its baselines' runs, found by key) and report (the
runs as measured, the CSV, the printed tables, the plot).
"""
from __future__ import annotations

import csv
import datetime
import itertools
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..drafters.eagle3 import Eagle3Drafter
from ..drafters.model import ModelDrafter
from ..drafters.ngram import NgramDrafter
from ..engine import Engine
from ..engine.costs import measure_costs
from ..engine.gamma import CostModel, expected_ops_ratio, predicted_speedup
from ..models import load_model
from ..models.eagle3 import is_eagle3_folder, load_eagle3
from ..models.loader import is_gguf
from ..sampling.params import SamplingParams
from ..shipped import cache_dir, heldout_prompts
from .corpus import heldout_chat_prompts

NGRAM_GAMMA = 4  # the n-gram drafter's gamma, and the gamma of the paper's Table 3 view
DRAFT_DRAFTERS = ("model", "eagle3")  # what drafts from BenchOptions.draft


@dataclass
class BenchOptions:
    target: Path
    draft: Path
    out_dir: Path
    prompts: int = 32
    new_tokens: int = 128
    repeats: int = 3
    gammas: tuple[int, ...] = tuple(range(1, 9))
    batches: tuple[int, ...] = (1, 8)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    plot: bool = True
    gguf: Path | None = None  # the target's GGUF file, for llama.cpp (run when llama-cpp-python is installed)
    label: str = "e2e"        # the output files' names start with it
    # "model": the draft is a draft model; "eagle3": an EAGLE-3 head's folder (a folder whose
    # config says it is one is taken as one, as Engine.from_pretrained does).
    drafter: str = "model"

    def __post_init__(self):
        self.target, self.draft, self.out_dir = Path(self.target), Path(self.draft), Path(self.out_dir)
        if self.drafter not in DRAFT_DRAFTERS:
            raise ValueError(f"bench: drafter must be one of {DRAFT_DRAFTERS}, got {self.drafter!r}")
        for name in ("prompts", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError(f"bench: gammas must be integers >= 1, got {list(self.gammas)}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"bench: batch sizes must be >= 1, got {list(self.batches)}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"bench: temperatures must be >= 0, got {list(self.temperatures)}")
        # A target is a folder or a GGUF file (the default pair's is); a draft is a folder.
        if not (self.target.is_dir() or (is_gguf(self.target) and self.target.is_file())):
            raise FileNotFoundError(f"bench: the target {self.target} is neither a checkpoint folder nor a GGUF file")
        if not self.draft.is_dir():
            raise FileNotFoundError(f"bench: draft folder {self.draft} does not exist")
        if is_eagle3_folder(self.draft):
            self.drafter = "eagle3"
        elif self.drafter == "eagle3":
            raise ValueError(f"bench: drafter 'eagle3' reads an EAGLE-3 head, and {self.draft}'s config.json does "
                             "not say it holds one")
        if self.gguf is not None:
            self.gguf = Path(self.gguf)
            if not self.gguf.is_file():
                raise FileNotFoundError(f"bench: GGUF file {self.gguf} does not exist")


@dataclass
class Tally:
    """One configuration's run (one repeat), summed over its batches."""
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    stats: list = field(default_factory=list)          # DecodeStats per batch (specengine runs)
    phases: dict[str, float] = field(default_factory=dict)
    batch_rounds: int = 0


def machine_name(device: torch.device | str = "cpu") -> str:
    """The GPU's name, or the CPU's model name, the vector instructions the C++ ops use on it and
    the threads torch uses (figures differ by CPU kind: every result names it)."""
    from ..engine.costs import cpu_name

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        from .. import _C
        isa = f", {_C.cpu_isa()} ops"
    except ImportError:
        isa = ""
    return f"{cpu_name()} ({platform.machine()}{isa}), {torch.get_num_threads()} threads"


@torch.inference_mode()
def eager_decode(model, prompt_batch: list[list[int]], new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
    """The plain baseline: prefill, then one target step per token on our model and its KV cache
    (an encoder-decoder model encodes the prompts, and its decoder starts at its start token)."""
    g = torch.Generator(model.device).manual_seed(seed)
    B = len(prompt_batch)
    if model.is_encoder_decoder:
        cache = model.new_cache(B, 1 + new_tokens)
        model.encode(cache, prompt_batch)
        tokens = torch.full((B, 1), model.config.decoder_start_token_id, device=model.device)
        lengths = [1] * B
    else:
        # Prompts of different lengths go in one call, right-padded: a row's padding writes K/V past
        # its length, hidden from its queries (each sees keys up to its own position), and its
        # first new token overwrites it.
        longest = max(len(p) for p in prompt_batch)
        cache = model.new_cache(B, longest + new_tokens)
        tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prompt_batch], device=model.device)
        lengths = [len(p) for p in prompt_batch]
    lengths = torch.tensor(lengths, device=model.device)
    hidden = model(tokens, cache.lengths.clone(), cache)[torch.arange(B, device=model.device), lengths - 1]
    cache.lengths.add_(lengths)
    out = []
    for i in range(new_tokens):
        logits = model.logits(hidden)
        nxt = (logits.argmax(-1) if temperature == 0
               else torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)[:, 0])
        out.append(nxt)
        # kv_len known on the host: no device read per token (on CUDA that would be a sync)
        hidden = model(nxt[:, None], cache.lengths.clone(), cache, kv_len=tokens.shape[1] + i + 1)[:, 0]
        cache.lengths.add_(1)
    return torch.stack(out, 1).tolist()


@torch.inference_mode()
def hf_decode(hf, prompt_batch, new_tokens, temperature, assistant=None) -> list[list[int]]:
    ids, mask = padded_batch(prompt_batch, left=not hf.config.is_encoder_decoder)
    # No EOS at all, as ignore_eos in our runs: min_new_tokens would instead forbid EOS, and pick
    # another token wherever EOS is the argmax (chat answers end within 64 tokens).
    kwargs = dict(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    if temperature == 0:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    if assistant is not None:
        kwargs.update(assistant_model=assistant)
    out = hf.generate(ids, **kwargs)
    # An encoder-decoder's output is its decoder's: the start token, then the new tokens.
    return out[:, 1 if hf.config.is_encoder_decoder else ids.shape[1]:].tolist()


def padded_batch(prompt_batch: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one [B, T] tensor of ids and its attention mask (1 on real
    tokens). A decoder-only model takes them left-padded, so that every row's new tokens start at
    column T (generate appends them there) and each row's positions, counted from its mask, start
    at 0; an encoder's input takes them right-padded, as its tokenizer would."""
    longest = max(len(p) for p in prompt_batch)
    ids, mask = [], []
    for p in prompt_batch:
        pad = longest - len(p)
        ids.append([0] * pad + p if left else p + [0] * pad)
        mask.append([0] * pad + [1] * len(p) if left else [1] * len(p) + [0] * pad)
    return torch.tensor(ids), torch.tensor(mask)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on one GGUF file, decoding token ids at batch 1."""

    def __init__(self, path: Path, n_ctx: int, lookup: bool = False):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=NGRAM_GAMMA) if lookup else None
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                         n_threads_batch=torch.get_num_threads(), draft_model=draft, verbose=False, seed=0)

    def decode(self, prompt_batch: list[list[int]], new_tokens: int, temperature: float) -> list[list[int]]:
        outputs = []
        for prompt in prompt_batch:
            self.llm.reset()
            # Every warp off but the temperature, and no repetition penalty: the plain distribution.
            tokens = self.llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0, reset=True)
            # generate() never stops on its own (EOS is one more token): new_tokens, as ignore_eos
            outputs.append(list(itertools.islice(tokens, new_tokens)))
        return outputs


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def rotated(items: list, turn: int) -> list:
    """items in turn order `turn`: the list started at item turn mod len(items), then wrapped."""
    start = turn % len(items)
    return items[start:] + items[:start]


def median_alpha(runs: list[dict]) -> float | None:
    """The median acceptance rate over the runs that tested drafts (None where none did: gamma="auto"
    may decode a whole run without drafting, at batch 8 on a CPU)."""
    alphas = [r["alpha"] for r in runs if r.get("alpha") is not None]
    return statistics.median(alphas) if alphas else None


def run_benchmark(options: BenchOptions) -> Path:
    """Plan the configurations, run them, derive the table's columns from the runs, report (print
    the tables, write the CSV and the plot); returns the CSV's path."""
    keys = plan(options)
    models = load(options)
    measured = run(options, models, keys)
    date = datetime.date.today().isoformat()
    write_runs(options, measured, date)  # the measurements as taken, before anything is derived from them
    rows = derive(options, models, measured, date)
    return report(options, models, measured, rows, date)


# --- plan ------------------------------------------------------------------------------------

LLAMACPP_WEIGHTS = ("bf16", "bf16-lookup")  # llama.cpp target-only, and with its prompt lookup


@dataclass(frozen=True)
class Key:
    """One configuration: what decodes (kind), with which drafter at which gamma, at which
    temperature and batch size. Runs and rows are found by key; `name` is only what the tables
    and the CSV call it."""
    kind: str                   # hf, hf_assisted, eager, spec, llamacpp
    temperature: float
    batch: int
    gamma: int | str = 0        # spec only: 0 = target-only, or "auto"
    drafter: str | None = None  # spec: model / eagle3 / ngram (None: target-only); llamacpp: one of LLAMACPP_WEIGHTS

    @property
    def name(self) -> str:
        if self.kind == "spec":
            what = ("spec target-only" if self.drafter is None else
                    f"spec {'draft' if self.drafter == 'model' else self.drafter} gamma={self.gamma}")
        elif self.kind == "llamacpp":
            what = f"llama.cpp {self.drafter}"
        else:
            what = {"hf": "hf", "hf_assisted": "hf-assisted", "eager": "eager"}[self.kind]
        return f"{what} T={self.temperature:g} B={self.batch}"

    def at_same(self, kind: str, **fields) -> Key:
        """Another configuration at this one's temperature and batch size (its baselines)."""
        return Key(kind, self.temperature, self.batch, **fields)


def runs_llamacpp(options: BenchOptions) -> bool:
    return options.gguf is not None and llama_cpp_available()


def plan(options: BenchOptions) -> list[Key]:
    """Every configuration the options ask for, in the order the tables list them."""
    keys = []
    for T in options.temperatures:
        for B in options.batches:
            keys.append(Key("hf", T, B))
            if B == 1 and options.drafter == "model":  # HF assisted generation cannot batch, nor read a head
                keys.append(Key("hf_assisted", T, B))
            keys.append(Key("eager", T, B))
            keys.append(Key("spec", T, B))
            keys += [Key("spec", T, B, g, options.drafter) for g in [*options.gammas, "auto"]]
            keys.append(Key("spec", T, B, NGRAM_GAMMA, "ngram"))
            if B == 1 and runs_llamacpp(options):
                keys += [Key("llamacpp", T, B, drafter=weights) for weights in LLAMACPP_WEIGHTS]
    return keys


# --- run -------------------------------------------------------------------------------------

@dataclass
class Models:
    """What the configurations decode with, loaded once, and the prompts they decode."""
    target: object
    tokenizer: object
    draft: object               # the draft model, or the EAGLE-3 head
    hf: object
    hf_draft: object            # None with a head (HF cannot draft with one)
    prompts: list[list[int]]
    peers: dict[str, LlamaCpp]  # by LLAMACPP_WEIGHTS
    # With a head: a target of its own, which keeps the features the head reads in every forward
    # (the other configurations' target must not pay for them). None with a draft model.
    feature_target: object = None

    @property
    def params_ratio(self) -> float:
        """The draft's parameters over the target's: c_hat of the paper's Table 1 "ops"."""
        return sum(p.numel() for p in self.draft.parameters()) / sum(p.numel() for p in self.target.parameters())


def load(options: BenchOptions) -> Models:
    from .reference import transformers_model

    engine = Engine.from_pretrained(options.target)
    target, tokenizer = engine.target, engine.tokenizer
    feature_target = hf_draft = None
    if options.drafter == "eagle3":
        feature_target = load_model(options.target)
        draft = load_eagle3(options.draft, feature_target)
    else:
        draft = load_model(options.draft)  # a draft folder may lack tokenizer files (it uses the target's)
    hf = transformers_model(options.target, target.is_encoder_decoder)
    if options.drafter == "model":
        hf_draft = transformers_model(options.draft, target.is_encoder_decoder)
    if getattr(tokenizer, "chat_template", None):
        prompts = heldout_chat_prompts(tokenizer, options.prompts, max_tokens=256)
    else:
        prompts = heldout_prompts(tokenizer, options.prompts, length=64, start_fraction=1 / 3)
    peers = {}
    if runs_llamacpp(options):
        from ..models.gguf import requantize_gguf

        n_ctx = max(len(p) for p in prompts) + options.new_tokens + 8
        bf16 = cache_dir() / f"{options.gguf.stem}.bf16.gguf"  # made once, beside the converted models
        if not bf16.is_file():
            bf16.parent.mkdir(parents=True, exist_ok=True)
            requantize_gguf(options.gguf, bf16.with_suffix(".tmp"), "BF16")
            bf16.with_suffix(".tmp").rename(bf16)
        peers = {"bf16": LlamaCpp(bf16, n_ctx), "bf16-lookup": LlamaCpp(bf16, n_ctx, lookup=True)}
    elif options.gguf is not None:
        print("llama-cpp-python is not installed: no llama.cpp rows (pip install 'specengine[llamacpp]')")
    return Models(target, tokenizer, draft, hf, hf_draft, prompts, peers, feature_target)


@dataclass
class Measurements:
    runs: dict[Key, list[dict]]    # per configuration, in plan order: one summary per repeat
    costs: dict[int, CostModel]    # step costs per batch size (c for Theorem 3.8, verifying k tokens)


class Decoder:
    """Decodes a batch of prompts in any configuration, into the tally of its run."""

    def __init__(self, options: BenchOptions, models: Models):
        self.options, self.models = options, models
        self.engines: dict[tuple, Engine] = {}  # one per (drafter, gamma), reused by every run

    def spec_engine(self, key: Key) -> Engine:
        m = self.models
        if (key.drafter, key.gamma) not in self.engines:
            drafter = {"model": lambda: ModelDrafter(m.draft, m.target.config.vocab_size, len(m.tokenizer)),
                       "eagle3": lambda: Eagle3Drafter(m.draft, m.target.config.vocab_size, len(m.tokenizer)),
                       "ngram": NgramDrafter, None: lambda: None}[key.drafter]()
            target = m.feature_target if key.drafter == "eagle3" else m.target
            self.engines[key.drafter, key.gamma] = Engine(target, m.tokenizer, drafter, gamma=key.gamma or 1,
                                                          time_phases=True)
        return self.engines[key.drafter, key.gamma]

    def decode(self, key: Key, rep: int, i: int, batch: list, tally: Tally):
        """Batch i of the prompts (key.batch of them) in one configuration, into its tally."""
        m, new_tokens, T = self.models, self.options.new_tokens, key.temperature
        t0 = time.perf_counter()
        if key.kind == "hf":
            tally.outputs += hf_decode(m.hf, batch, new_tokens, T)
        elif key.kind == "hf_assisted":
            tally.outputs += hf_decode(m.hf, batch, new_tokens, T, assistant=m.hf_draft)
        elif key.kind == "llamacpp":
            tally.outputs += m.peers[key.drafter].decode(batch, new_tokens, T)
        elif key.kind == "eager":
            tally.outputs += eager_decode(m.target, batch, new_tokens, T, seed=rep * 1000 + i)
        else:
            params = [SamplingParams(max_new_tokens=new_tokens, temperature=T, ignore_eos=True,
                                     seed=rep * 1000 + i * 10 + j) for j in range(len(batch))]
            e = self.spec_engine(key)
            tally.outputs += [r.token_ids for r in e.generate(batch, params)]
            tally.stats.append(e.last_run_stats)
            tally.batch_rounds += e.last_run_rounds
            for name, sec in e.last_run_phases.items():
                tally.phases[name] = tally.phases.get(name, 0.0) + sec
        tally.seconds += time.perf_counter() - t0


def summary(tally: Tally) -> dict:
    """One configuration's run: seconds, tokens and outputs; for specengine, its drafts' alpha,
    tokens per target call, accepted-length histogram, drafts made and accepted by draft position,
    rounds and phases."""
    stats = tally.stats
    run_stats = dict(seconds=tally.seconds, tokens=sum(len(o) for o in tally.outputs), outputs=tally.outputs)
    if stats:
        accepted = sum(s.accepted for s in stats)
        tested = accepted + sum(s.rejections for s in stats)
        run_stats.update(alpha=accepted / tested if tested else None,
                         tokens_per_call=sum(s.generated_tokens for s in stats) / sum(s.rounds for s in stats),
                         histogram=[sum(h) for h in zip(*(s.accepted_histogram for s in stats))],
                         drafted_by_position=[sum(n) for n in zip(*(s.drafted_by_position for s in stats))],
                         accepted_by_position=[sum(n) for n in zip(*(s.accepted_by_position for s in stats))],
                         batch_rounds=tally.batch_rounds, phases=tally.phases)
    return run_stats


def run(options: BenchOptions, models: Models, keys: list[Key]) -> Measurements:
    """A warm-up (every configuration once, on one batch), the step costs at each batch size, then
    the interleaved repeats."""
    from tqdm import tqdm

    decoder, prompts = Decoder(options, models), models.prompts
    for key in tqdm(keys, desc="warm-up"):
        decoder.decode(key, 99, 0, prompts[: key.batch], Tally())
    # c of Theorem 3.8 is a draft model's step against the target's (a head's costs are not modelled)
    draft = models.draft if options.drafter == "model" else None
    costs = {B: measure_costs(models.target, draft, max(options.gammas), batch_size=B) for B in options.batches}
    # Interleaved batch by batch: every configuration of a batch size decodes batch i before any
    # decodes batch i + 1, so that a slow stretch of the machine falls on all alike, not on the
    # one configuration that ran through it. The order of the configurations turns by one every
    # batch, so that none always runs first.
    batches = {B: [prompts[i: i + B] for i in range(0, len(prompts), B)] for B in options.batches}
    runs: dict[Key, list[dict]] = {key: [] for key in keys}
    with tqdm(total=options.repeats * sum(len(batches[k.batch]) for k in keys), desc="benchmark") as bar:
        for rep in range(options.repeats):
            tallies = {key: Tally() for key in keys}
            for B in options.batches:
                at_batch = [key for key in keys if key.batch == B]
                for i, batch in enumerate(batches[B]):
                    for key in rotated(at_batch, rep * len(batches[B]) + i):
                        decoder.decode(key, rep, i, batch, tallies[key])
                        bar.update()
            for key in keys:
                runs[key].append(summary(tallies[key]))
    return Measurements(runs, costs)


# --- derive ----------------------------------------------------------------------------------

def derive(options: BenchOptions, models: Models, measured: Measurements, date: str) -> list[dict]:
    """One CSV row per configuration, in plan order: what measured it, its median tokens per
    second and the ratios to its baselines, its drafts' alpha and Theorem 3.8's predictions next
    to the measured speedup, where its rounds' time goes, and whether its greedy outputs equal HF's."""
    import transformers

    runs, costs = measured.runs, measured.costs
    rate = {key: statistics.median(r["tokens"] / r["seconds"] for r in key_runs) for key, key_runs in runs.items()}
    # Every row says what measured it: the HF baselines depend on transformers' version as much
    # as ours on torch's.
    measured_by = dict(machine=machine_name(), date=date, torch=torch.__version__,
                       transformers=transformers.__version__, specengine=__version__,
                       python=platform.python_version())
    rows = []
    for key, key_runs in runs.items():
        assisted = key.at_same("hf_assisted")
        llamacpp = key.at_same("llamacpp", drafter="bf16")
        alpha = median_alpha(key_runs)
        row = dict(**measured_by, config=key.name, kind=key.kind, batch=key.batch, temperature=key.temperature,
                   gamma=key.gamma, drafter=key.drafter or "", tokens_per_s=round(rate[key], 2),
                   vs_hf=round(rate[key] / rate[key.at_same("hf")], 3),
                   vs_hf_assisted=round(rate[key] / rate[assisted], 3) if assisted in rate
                   else "n/a (HF assisted: batch 1, a draft model only)",
                   vs_llamacpp_bf16=round(rate[key] / rate[llamacpp], 3) if llamacpp in rate else "",
                   alpha=round(alpha, 4) if alpha is not None else "",
                   alpha_by_position=alpha_by_position(key_runs),
                   tokens_per_target_call=round(statistics.median(r["tokens_per_call"] for r in key_runs), 3)
                   if "tokens_per_call" in key_runs[0] else "",
                   c=round(draft_cost(costs[key.batch]), 4) if key.drafter == "model" else "",
                   measured_speedup=round(rate[key] / rate[key.at_same("spec")], 3) if key.kind == "spec" else "",
                   **predictions(key, alpha, costs[key.batch], models.params_ratio))
        rows.append(dict(row, **round_profile(key, key_runs), **greedy_check(key, runs)))
    return rows


def alpha_by_position(key_runs: list[dict]) -> str:
    """Acceptance at each draft position over all the runs (drafts accepted there / drafts made
    there), space-separated, "n/a" at a position never drafted; "" for a configuration that drafted
    nothing. Pooled rather than a median of runs: the far positions of gamma="auto" see few drafts
    per run."""
    if "drafted_by_position" not in key_runs[0]:
        return ""
    drafted = [sum(n) for n in zip(*(r["drafted_by_position"] for r in key_runs))]
    accepted = [sum(n) for n in zip(*(r["accepted_by_position"] for r in key_runs))]
    if not any(drafted):
        return ""
    return " ".join(f"{a / d:.3f}" if d else "n/a" for a, d in zip(accepted, drafted))


def draft_cost(costs: CostModel) -> float:
    """c of Theorem 3.8: a draft step's cost in target steps (on one token)."""
    return costs.draft_step_s / costs.verify_s[0]


def predictions(key: Key, alpha: float | None, costs: CostModel, params_ratio: float) -> dict:
    """For the draft model at a fixed gamma: Theorem 3.8's speedup (with one target step per
    round, and with the measured cost of verifying gamma + 1 tokens), and the paper's Table 1 "ops"."""
    g = key.gamma if isinstance(key.gamma, int) else None
    modelled = key.drafter == "model" and g and alpha is not None
    return dict(predicted_speedup=round(predicted_speedup(alpha, g, draft_cost(costs)), 3) if modelled else "",
                predicted_with_verify_cost=round(costs.tokens_per_second(alpha, g) * costs.verify_s[0], 3)
                if modelled else "",
                ops_ratio=round(expected_ops_ratio(alpha, g, params_ratio), 3) if modelled else "")


def round_profile(key: Key, key_runs: list[dict]) -> dict:
    """Where a specengine round's time goes (its median run): phases per round, in ms, and the
    prefill's share of the run."""
    if key.kind != "spec":
        return {}
    run_ = sorted(key_runs, key=lambda r: r["seconds"])[len(key_runs) // 2]
    ph, rounds = run_["phases"], run_["batch_rounds"]
    return dict(round_ms=round(1e3 * (ph["total"] - ph["prefill"]) / rounds, 2),
                **{f"{k}_ms_per_round": round(1e3 * ph[k] / rounds, 2) for k in ("draft", "verify", "accept", "host")},
                prefill_share=round(ph["prefill"] / ph["total"], 3))


def greedy_check(key: Key, runs: dict[Key, list[dict]]) -> dict:
    """Whether every run's greedy outputs equal HF's greedy outputs on the same batches (for
    specengine, the eager loop and llama.cpp at temperature 0)."""
    if key.kind not in ("spec", "eager", "llamacpp") or key.temperature != 0:
        return {}
    reference = runs[key.at_same("hf")][0]["outputs"]
    return dict(greedy_equals_hf=all(r["outputs"] == reference for r in runs[key]))


# --- report ----------------------------------------------------------------------------------

def write_runs(options: BenchOptions, measured: Measurements, date: str):
    """Every run's measurements as taken (outputs aside): <label>-<date>-runs.json."""
    options.out_dir.mkdir(parents=True, exist_ok=True)
    raw = {key.name: [{k: v for k, v in r.items() if k != "outputs"} for r in key_runs]
           for key, key_runs in measured.runs.items()}
    (options.out_dir / f"{options.label}-{date}-runs.json").write_text(json.dumps(raw, indent=1) + "\n")


def report(options: BenchOptions, models: Models, measured: Measurements, rows: list[dict], date: str) -> Path:
    """Write the CSV, print the tables, plot; returns the CSV's path."""
    out = options.out_dir / f"{options.label}-{date}.csv"
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    gammas = list(options.gammas)
    print_tables(rows, measured.costs, gammas)
    if models.target.is_encoder_decoder:
        paper_c_view(rows)
    if options.plot:
        plot(rows, measured.runs, gammas, options.out_dir / f"{options.label}-{date}.png")
    print(f"wrote {out}")
    return out


def print_tables(rows: list[dict], costs: dict, gammas: list[int]):
    """The rows, the step costs, where a round's time goes, and the paper's Table 3 view."""
    for row in rows:
        print(f"{row['config']:38s} {row['tokens_per_s']:8.1f} tok/s  vs HF {row['vs_hf']:6.2f}x  "
              f"alpha {row['alpha']!s:6s} speedup {row['measured_speedup']!s:6s} predicted {row['predicted_speedup']!s:6s}"
              f" greedy==HF {row.get('greedy_equals_hf', '')}")
    print(f"\nMeasured step costs (ms): target on k = 1..{max(gammas) + 1} tokens, one draft step")
    for B, cm in costs.items():
        print(f"  batch {B}: target {[round(1e3 * t, 2) for t in cm.verify_s]}, draft {1e3 * cm.draft_step_s:.2f}, "
              f"c = {cm.draft_step_s / cm.verify_s[0]:.3f}")
    print("\nWhere a round's time goes (ms per round: draft / verify forward / accept kernel / host)")
    for row in rows:
        if "round_ms" in row and row["drafter"] != "ngram":
            print(f"  {row['config']:38s} {row['round_ms']:7.2f} = {row['draft_ms_per_round']:6.2f} + "
                  f"{row['verify_ms_per_round']:6.2f} + {row['accept_ms_per_round']:5.2f} + {row['host_ms_per_round']:5.2f}")
    print("\nAcceptance by draft position (drafts accepted / made at positions 1..gamma), the draft model or head")
    for row in rows:
        if row["drafter"] in DRAFT_DRAFTERS:
            print(f"  {row['config']:38s} {row['alpha_by_position'] or 'no drafts'}")
    # The draft model at gamma 4 when it ran (else its largest gamma), the n-gram drafter at NGRAM_GAMMA.
    model_gamma = NGRAM_GAMMA if NGRAM_GAMMA in gammas else max(gammas)
    print("\nPaper Table 3 view: alpha per (drafter, temperature) at the smallest batch")
    for drafter, g, label in (("model", model_gamma, "draft model"), ("eagle3", model_gamma, "EAGLE-3 head"),
                              ("ngram", NGRAM_GAMMA, "n-gram (prompt lookup)")):
        for row in rows:
            if row["drafter"] == drafter and row["gamma"] == g and row["batch"] == rows[0]["batch"]:
                print(f"  {label:24s} gamma {g} T={row['temperature']:g}: alpha {row['alpha']}")


# Appendix A.3 / Table 4 of the paper: c of T5-small drafting for T5-XXL on a TPU-v4 (not measurable here).
PAPER_T5_SMALL_XXL_C = 0.02


def paper_c_view(rows: list[dict]):
    """Theorem 3.8 at each measured alpha, with the paper's T5-small -> T5-XXL cost ratio in place of ours."""
    print(f"\nTheorem 3.8 at the measured alpha with the paper's c = {PAPER_T5_SMALL_XXL_C} (T5-small for T5-XXL, "
          "Table 4; not measured here)")
    for row in rows:
        if row["drafter"] == "model" and isinstance(row["gamma"], int) and row["alpha"] != "":
            print(f"  {row['config']:38s} alpha {row['alpha']:.3f}: "
                  f"{predicted_speedup(row['alpha'], row['gamma'], PAPER_T5_SMALL_XXL_C):.2f}x "
                  f"(with our c {row['c']}: {row['predicted_speedup']}x)")


def plot(rows: list[dict], runs: dict[Key, list[dict]], gammas: list[int], path: Path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'specengine[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = rows[0]["batch"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for T in sorted({r["temperature"] for r in rows}):
        pts = [(r["gamma"], r["measured_speedup"], r["predicted_speedup"]) for r in rows
               if r["drafter"] in DRAFT_DRAFTERS and isinstance(r["gamma"], int) and r["batch"] == batch
               and r["temperature"] == T]
        if pts:
            g, m, p = zip(*pts)
            axes[0].plot(g, m, "o-", label=f"measured T={T:g}")
            if "" not in p:  # a head's speed-up is not modelled
                axes[0].plot(g, p, "x--", label=f"Theorem 3.8 T={T:g}")
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].set(xlabel="gamma", ylabel=f"speedup over target-only (batch {batch})", title="speedup vs gamma")
    axes[0].legend()
    for key, key_runs in runs.items():
        if key.drafter in DRAFT_DRAFTERS and key.gamma == max(gammas) and key.batch == batch:
            hist = [sum(h) for h in zip(*(r["histogram"] for r in key_runs))]
            axes[1].bar([i + (0.2 if key.temperature else -0.2) for i in range(len(hist))], hist, width=0.4,
                        label=f"T={key.temperature:g}")
    axes[1].set(xlabel=f"drafts accepted per round (gamma={max(gammas)})", ylabel="rounds",
                title="accepted-length histogram")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
