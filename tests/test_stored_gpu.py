"""A model whose matrices are kept as a GGUF file stores them (layers.blocks; Q8_0, Q4_1 and Q4_K)
on the "triton" backend: the Triton block kernels (kernels/blocks.py) beside the step kernels, in
Triton's interpreter on a CPU and compiled on CUDA (the cuda params, marked gpu), against the same
model on the "torch" backend (dequantized matrices, then F.linear): logits within float32
summation error for a ragged prefill, a verification-sized step and a decode step; the same
greedy tokens through the Engine, target-only and speculative (the model drafting for itself, so
that every round verifies gamma + 1 tokens a row against what its decode steps computed); and
the kernels ran: no fallback, the products went through ops.blocks_triton. Moved to CUDA, the model
holds its packed q/k/v and gate/up merged into one part each (layers.blocks; on a CPU the move is
emulated), and computes the same bits in fewer launches per layer."""
import os

import torch

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before a kernel module
# is imported (conftest.py does the same).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specengine import Engine, SamplingParams  # noqa: E402
from specengine.devtools.tiny import stored_copy  # noqa: E402
from specengine.drafters.model import ModelDrafter  # noqa: E402
from specengine.kernels import blocks as kernels  # noqa: E402
from specengine.layers import blocks as block_layers  # noqa: E402
from specengine.ops import blocks_triton  # noqa: E402
from specengine.ops.product import triton_backend_product  # noqa: E402
from specengine.steps.feed import feed  # noqa: E402

from engine_util import assert_kernels_ran, device_head_dims, tiny_model  # noqa: E402
from kernel_util import count_launches  # noqa: E402

V = 32
PROMPTS = [[1, 2, 3, 4, 5], [7, 7], [3, 9, 27, 1]]
# The interpreter pays per program and operation (about 0.7 s a forward of the one-layer model):
# there two prompts and 4 tokens (with gamma 3, one round after the prefill); compiled, more.
ENGINE_PROMPTS = {"cpu": PROMPTS[:2], "cuda": PROMPTS}
GREEDY = {"cpu": SamplingParams(max_new_tokens=4, temperature=0),
          "cuda": SamplingParams(max_new_tokens=16, temperature=0)}
# The weight types: 32-weight blocks with a scale (Q8_0), a scale and a minimum (Q4_1), and a
# K-quant (Q4_K, 256-weight blocks of sub-block scales: head_dim 64 gives rows of 256 weights).
WEIGHT_TYPES = ["Q8_0", "Q4_1", "Q4_K"]


@pytest.fixture
def interpreter_tiles(monkeypatch):
    """In the interpreter (which pays per program and per operation, not per element), the decode
    kernel on tiles of up to 256 weight rows instead of 16-32: 8 times fewer programs, the same
    bits (a row's sums follow the split of K, counted at kernels.SPLIT_BLOCK_N whatever the tile,
    never the tile: test_blocks_triton's batch-invariance test). Compiled, the GPU's tiles."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(kernels, "GEMV_BLOCK_N", 256)
        monkeypatch.setattr(kernels, "GEMV_TILE", 256 * kernels.GEMV_BLOCK_R)


def stored_model(weight_type: str, head_dim: int, device: str):
    """A tiny Llama (four query heads on two KV heads of head_dim, one layer on the interpreter)
    with its matrices in weight_type, on device."""
    layers = 2 if device == "cuda" else 1  # the interpreter pays per program and operation
    dense = tiny_model(V, seed=0, num_layers=layers, logit_scale=3.0, max_positions=64, head_dim=head_dim)
    return stored_copy(dense, weight_type).to(device)


def run_logits(model, backend: str) -> torch.Tensor:
    """Logits of a ragged prefill, then a 3-token step on every row, then a 1-token step, on backend."""
    model.use_backend(backend)
    cache = model.new_cache(len(PROMPTS), 32)
    device = model.device
    verify = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=device)
    step = torch.tensor([[10], [11], [12]], device=device)
    with torch.no_grad():
        first = model.logits(feed(model, cache, PROMPTS))
        second = model.logits(model(verify, cache.lengths.clone(), cache))
        cache.lengths.add_(3)
        third = model.logits(model(step, cache.lengths.clone(), cache))
    return torch.cat([first.flatten(), second.flatten(), third.flatten()])


def greedy_tokens(model, backend: str, gamma: int = 0) -> list[list[int]]:
    """Greedy tokens through the Engine on backend: target-only, or the model drafting for itself."""
    model.use_backend(backend)
    drafter = ModelDrafter(model, V, V) if gamma else None
    device = model.device.type
    results = Engine(model, drafter=drafter, gamma=gamma or 4).generate(ENGINE_PROMPTS[device], GREEDY[device])
    return [r.token_ids for r in results]


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_stored_matrices_on_the_triton_backend(device, head_dim, weight_type, monkeypatch, interpreter_tiles):
    model = stored_model(weight_type, head_dim, device)
    products = []
    launch = blocks_triton.linear_blocks_triton
    monkeypatch.setattr(blocks_triton, "linear_blocks_triton",
                        lambda x, matrix, bias=None: products.append(x.shape) or launch(x, matrix, bias))

    want = run_logits(model, "torch")
    assert not products  # the torch backend computes from dequantized matrices
    got = run_logits(model, "triton")
    assert_kernels_ran(model)
    assert model.backend.name == "triton" and model.model.layers[0].mlp.down_proj.product is triton_backend_product
    assert {shape[-2] for shape in products if len(shape) == 3} >= {1, 3}  # decode and verification steps
    # float32 summation order only: a wrong weight (a nibble, a scale) is orders of magnitude out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    baseline = greedy_tokens(model, "torch")
    assert greedy_tokens(model, "triton") == baseline
    assert greedy_tokens(model, "triton", gamma=3) == baseline
    assert_kernels_ran(model)


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("device, head_dim", device_head_dims())
def test_the_device_copy_merges_parts_into_fewer_launches(device, head_dim, weight_type, monkeypatch,
                                                           interpreter_tiles):
    """The model with the file's parts on the device (the merge held off), then moved there as a
    model is (on a CPU, emulated: a CPU that holds parts merged, as CUDA does): its q/k/v and
    gate/up, each of one type, become one part each, and its logits are the same bits in fewer
    block launches: per decoder layer, 4 products instead of 7 (3 q/k/v, o, 2 gate/up, down)."""
    with monkeypatch.context() as held_off:
        held_off.setattr(block_layers, "holds_parts_merged", lambda device: False)
        model = stored_model(weight_type, head_dim, device)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (len(attn.qkv_proj.weight_types), len(mlp.gate_up_proj.weight_types)) == (3, 2)
    layers = model.config.num_layers
    launches = count_launches(monkeypatch)
    stored = run_logits(model, "triton")
    stored_launches = dict(launches)

    if device == "cpu":
        monkeypatch.setattr(block_layers, "holds_parts_merged", lambda device: True)
    model.to(device)
    assert (len(attn.qkv_proj.weight_types), len(mlp.gate_up_proj.weight_types)) == (1, 1)
    assert attn.qkv_proj.matrix.shape == (attn.q_size + 2 * attn.kv_size, model.config.hidden_size)
    launches.clear()
    merged = run_logits(model, "triton")
    assert_kernels_ran(model)
    assert torch.equal(merged.view(torch.int32), stored.view(torch.int32))
    # run_logits makes three forwards, each an embedding lookup, the layers' products and the head's
    assert stored_launches["_rows_kernel"] == launches["_rows_kernel"] == 3
    assert stored_launches["_gemv_kernel"] == 3 * (7 * layers + 1)
    assert launches["_gemv_kernel"] == 3 * (4 * layers + 1)
    assert launches["_combine_kernel"] == stored_launches["_combine_kernel"]  # one a product whose K is split
