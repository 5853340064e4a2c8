"""One rank of the tensor-parallel tests (tests/test_tensor_parallel.py), run under torchrun:

    torchrun --nproc-per-node 2 tests/tp_worker.py SPEC.json OUT_DIR

SPEC names checkpoint folders and what to run on them. Each rank writes OUT_DIR/rank<r>.json
(generated tokens, parameter bytes) and OUT_DIR/rank<r>.safetensors (logits), which the test
compares with one process's results and across the ranks.
"""
import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from specengine import Engine, SamplingParams  # noqa: E402
from specengine.layers.parallel import init_tensor_parallel  # noqa: E402
from specengine.models.loader import load_model  # noqa: E402

from tp_cases import GENERATIONS, logit_trace, serve_with_aborts  # noqa: E402


def main(spec_path: str, out_dir: str):
    if os.environ.get("SPECENGINE_TEST_ISA"):  # the test session's limit (tests/conftest.py)
        from specengine import _C

        _C.set_cpu_isa_limit(os.environ["SPECENGINE_TEST_ISA"])
    spec = json.loads(Path(spec_path).read_text())
    tp, device = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu")
    logits, report = {}, {"parameter_bytes": {}, "generations": {}}
    for name, folder in spec["models"].items():
        model = load_model(folder, tp=tp)
        report["parameter_bytes"][name] = sum(p.numel() * p.element_size() for p in model.parameters())
        for i, t in enumerate(logit_trace(model, spec["sequences"])):
            logits[f"{name}/{i}"] = t.contiguous()
    target, draft = spec["pair"]
    for name, (gamma, params) in GENERATIONS.items():
        engine = Engine.from_pretrained(target, draft, gamma=gamma, tensor_parallel=tp.world_size)
        results = engine.generate(spec["prompts"], [SamplingParams(**p) for p in params])
        report["generations"][name] = [r.token_ids for r in results]
    engine = Engine.from_pretrained(target, draft, gamma=3, tensor_parallel=tp.world_size)
    report["serving"] = serve_with_aborts(engine, spec["prompts"])
    save_file(logits, f"{out_dir}/rank{tp.rank}.safetensors")
    Path(f"{out_dir}/rank{tp.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
