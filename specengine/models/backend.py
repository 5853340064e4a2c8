"""The backend a model runs on: which implementation of its ops, chosen once per model.

  "cpp-layers"  a CPU, float32 compute, every matrix stored in bfloat16 (the loader's choice for a
                bfloat16 checkpoint there), the model unsplit: each decoder layer of a decode-sized
                call (fewer than ops.product.GEMM_MIN_TOKENS_PER_ROW tokens per row) is one C++
                call (ops.decoder_layer), instead of about 20 Python and torch calls; prefill-sized
                calls run "cpp-ops", whose products are GEMMs (ops.product)
  "cpp-ops"     a CPU, float32 compute: specengine._C's ops one by one (norms, attention)
  "triton"      CUDA: specengine.kernels' step kernels (norms with the residual add, rotary with
                the cache write and Qwen3's q/k norms, split-KV attention, SiLU-and-multiply,
                products of stored matrices; dense matrices run torch's product); on a CPU only
                under Triton's interpreter (TRITON_INTERPRET=1: tests)
  "torch"       torch ops on any device and dtype, products included (F.linear on the weights
                dequantized or widened to the compute dtype): the reference of the others

Default: "triton" on CUDA (where the model has it, else "torch"); on a CPU with float32 compute
"cpp-layers" where it can run, else "cpp-ops"; otherwise "torch". The loader chooses when it
builds a model (models.loader.empty_model), a model built directly in its constructor, and moving
or casting a model (model.to(...)) chooses again; model.use_backend(name) asks for one, and a
ValueError says why it cannot run the model. ops/ takes the choice from there: each op is called
with the backend's implementation (Backend.impl: "cpp", "triton" or "reference"), and every
matrix product is the backend's (Backend.product, from ops.product), set into the model's layers
(layers.linear.ProductLayer) when the backend is chosen.

One condition is per call: a forward with gradients enabled (training) runs "torch", since the
C++ ops and the Triton kernels have no autograd (its products too, where autograd records them:
ops.product).

The first forward on "triton" compiles the kernels. If that fails (a Triton that cannot compile
them for this GPU), the model says why once (a warning, and triton_fallback_reason), redoes that
forward on "torch" and stays there, as CUDA graphs fall back to eager.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..layers.blocks import BlockEmbedding
from ..layers.linear import ProductLayer
from ..ops.product import PRODUCTS

log = logging.getLogger(__name__)


class Backend(NamedTuple):
    name: str           # a key of BACKENDS
    impl: str           # what its ops run: "cpp", "triton" or "reference" (each op's impl)
    whole_layers: bool  # decode-sized calls run each decoder layer as one C++ call
    product: Callable[..., torch.Tensor]  # every matrix product of the model: ops.product's of impl


BACKENDS = {b.name: b for b in (Backend("cpp-layers", "cpp", True, PRODUCTS["cpp"]),
                                Backend("cpp-ops", "cpp", False, PRODUCTS["cpp"]),
                                Backend("triton", "triton", False, PRODUCTS["triton"]),
                                Backend("torch", "reference", False, PRODUCTS["reference"]))}
TORCH = BACKENDS["torch"]


def triton_interpreted() -> bool:
    """Whether Triton's kernels run in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def choose_backend(model: "RunsOnBackend", name: str | None = None) -> Backend:
    """The backend `name` for this model (None: its default), or a ValueError saying why it cannot run it."""
    device, dtype = model.device, model.dtype
    if name is None:
        if device.type == "cuda":
            name = "triton" if "triton" in model.SUPPORTED_BACKENDS else "torch"
        elif device.type == "cpu" and dtype == torch.float32:
            name = "cpp-layers" if _unavailable(model, "cpp-layers") is None else "cpp-ops"
        else:
            name = "torch"
    why = _unavailable(model, name)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run this {type(model).__name__}: {why}")
    return BACKENDS[name]


def _unavailable(model: "RunsOnBackend", name: str) -> str | None:
    """Why backend `name` cannot run the model, or None."""
    if name not in model.SUPPORTED_BACKENDS:
        return f"it runs on {', '.join(map(repr, model.SUPPORTED_BACKENDS))}"
    device, dtype = model.device, model.dtype
    if name in ("cpp-layers", "cpp-ops"):
        if device.type != "cpu" or dtype != torch.float32:
            return f"the C++ ops compute in float32 on a CPU; the model computes in {dtype} on {device}"
        if name == "cpp-layers" and model.tp is not None:
            return "a split model runs op by op (its all-reduces sit between the ops): use 'cpp-ops'"
        if name == "cpp-layers" and model.whole_layer_weights() is None:
            return ("the whole-layer op reads matrices stored in bfloat16 or as a GGUF file stores them, and not all "
                    "of the model's are: use 'cpp-ops'")
    if name == "triton" and not (device.type in ("cuda", "meta") or (device.type == "cpu" and triton_interpreted())):
        return (f"the Triton kernels run on CUDA tensors (or CPU ones in Triton's interpreter, TRITON_INTERPRET=1); "
                f"the model is on {device}")
    return None


class RunsOnBackend(nn.Module):
    """A model with a backend (see the module docstring). Subclasses set SUPPORTED_BACKENDS and
    have device, dtype, tp and whole_layer_weights() (None unless every matrix is bfloat16)."""

    SUPPORTED_BACKENDS: tuple[str, ...] = tuple(BACKENDS)
    backend: Backend = TORCH
    # Why "triton" was given up for "torch" (its first forward failed), or None.
    triton_fallback_reason: str | None = None
    _requested_backend: str | None = None  # use_backend's name (None: the default)
    _backend_proven = True                 # False until "triton" ran a forward

    def use_backend(self, name: str | None = None) -> Backend:
        """Run on backend `name` from the next forward on (None: the default for this model's device
        and dtypes); a ValueError says why it cannot run the model. Returns the backend."""
        self.backend = choose_backend(self, name)
        self._set_layer_ops(self.backend)
        self._requested_backend = name
        self.triton_fallback_reason = None
        self._backend_proven = self.backend.name != "triton"
        return self.backend

    def run_on_backend(self, forward, *args):
        """forward(*args, backend) on this call's backend: the model's, or "torch" with gradients
        enabled. The first forward on "triton" falls back to "torch" if the kernels fail."""
        if torch.is_grad_enabled():
            return forward(*args, TORCH)
        if self._backend_proven:
            return forward(*args, self.backend)
        try:  # the first forward compiles the kernels; the same forward on the torch path redoes its writes
            out = forward(*args, self.backend)
        except Exception as exc:  # noqa: BLE001 (any failure means: the torch path, and say why)
            self.backend, self.triton_fallback_reason = TORCH, f"{type(exc).__name__}: {exc}"
            self._set_layer_ops(TORCH)
            self._backend_proven = True
            log.warning("the Triton step kernels failed (%s); running the torch path", self.triton_fallback_reason)
            return forward(*args, TORCH)
        self._backend_proven = True
        return out

    def _set_layer_ops(self, backend: Backend):
        """The layers run the backend's products, and stored embeddings its lookup."""
        for module in self.modules():
            if isinstance(module, ProductLayer):
                module.product = backend.product
            elif isinstance(module, BlockEmbedding):
                module.impl = backend.impl

    def _apply(self, fn, recurse=True):
        """Moving or casting the model (model.to(...) and friends) chooses its backend again."""
        result = super()._apply(fn, recurse)
        self.use_backend(self._requested_backend)
        return result
