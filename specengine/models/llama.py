"""One decoder-only Llama-family model: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2, Qwen3.

Forward takes tokens [B, T] and per-row start positions [B], writes K/V into a static
cache at those positions and lets each row attend only to its own prefix. Module names
match transformers', except that q/k/v and gate/up are packed into one matrix each
(checkpoint_tensors maps the checkpoint's names onto their rows). Built with a TensorParallel,
the model holds one rank's share (layers.parallel; checkpoint_slices says what it reads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..layers.blocks import BlockEmbedding, BlockLinear, HoldsBlockMatrix, TiedBlockHead
from ..layers.kv_cache import StaticKVCache
from ..layers.linear import Linear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.parallel import TensorParallel, TensorParallelError
from ..layers.rotary import rope_cos_sin, rope_inv_freq
from ..layers.tracked import KeepsParameterViews
from ..ops.activation import silu_mul
from ..ops.attention import attention_mask, cached_attention
from ..ops.decoder_layer import DecoderLayerWeights, decoder_layer
from ..ops.product import gemm_sized
from .backend import Backend, RunsOnBackend
from .config import ModelConfig


@dataclass
class StepInputs:
    """What every layer of one forward shares."""

    positions: torch.Tensor   # [B, T] int64, absolute position of each token
    cos: torch.Tensor         # [B, T, head_dim] rotary tables at those positions
    sin: torch.Tensor         # [B, T, head_dim]
    kv_len: int               # cache keys a query may see (max position + 1, clipped to capacity)
    impl: str                 # the ops' implementation: "cpp", "triton" or "reference" (models.backend)
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool for the reference attention (None for the others)


@dataclass
class PartialForward:
    """A forward cut between decoder layers (LlamaModel.forward_layers), so that a long prompt's
    chunk can be spread over several steps of the engine: what the layers still to run need."""

    tokens: torch.Tensor            # [B, T] int64
    positions: torch.Tensor         # [B, T] int64, absolute position of each token
    kv_len: int                     # as forward's
    x: torch.Tensor | None = None   # [B, T, D] the residual stream after layers_done layers
    delta: torch.Tensor | None = None  # [B, T, D] the last layer's output, which the next norm adds to x
    layers_done: int = 0
    # [B, T, len(feature_layers) * D] float32: the states captured so far (LlamaForCausalLM.capture_features)
    features: torch.Tensor | None = None


def _matrix(in_features: int, out_features: int, bias: bool, stored: bool) -> nn.Module:
    """A projection: over a matrix as a GGUF file stores it (layers.blocks), or a dense one."""
    return BlockLinear(in_features, out_features, bias) if stored else Linear(in_features, out_features, bias=bias)


def _output(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None, stored: bool) -> nn.Module:
    """o_proj and down_proj: row-parallel (an all-reduce) when the model is split."""
    return _matrix(in_features, out_features, bias, stored) if tp is None else RowParallelLinear(
        in_features, out_features, bias, tp)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None, stored: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = cfg.sliding_window
        self.head_dim = cfg.head_dim
        # This rank's heads (all of them unsplit); a KV head's query heads stay on its rank.
        self.num_heads = cfg.num_heads if tp is None else tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = cfg.num_kv_heads if tp is None else tp.split(cfg.num_kv_heads, "num_key_value_heads")
        # q, k and v in one matrix: one product per step instead of three (checkpoints keep
        # q_proj, k_proj and v_proj; the loader writes them into their rows, see checkpoint_tensors).
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = _matrix(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, stored)
        self.o_proj = _output(self.q_size, cfg.hidden_size, cfg.o_bias, tp, stored)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.norm_eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, step: StepInputs, cache: StaticKVCache) -> torch.Tensor:
        # x [B, T, hidden]
        B, T, _ = x.shape
        # Views of the packed output: the C++ op reads the three column blocks in place.
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        cache_k, cache_v = cache.layer(self.layer_idx)
        q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        out = cached_attention(q, k, v, step.cos, step.sin, step.positions, cache_k, cache_v, step.kv_len,
                               self.sliding_window, step.impl, q_norm=q_norm, k_norm=k_norm, norm_eps=self.norm_eps,
                               mask=step.mask, check=ops.CHECK_MODEL_CALLS)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, stored: bool = False):
        super().__init__()
        inter = cfg.intermediate_size
        self.intermediate_size = inter if tp is None else tp.split(inter, "intermediate_size")
        # gate and up in one matrix (checkpoints keep gate_proj and up_proj, see checkpoint_tensors).
        self.gate_up_proj = _matrix(cfg.hidden_size, 2 * self.intermediate_size, cfg.mlp_bias, stored)
        self.down_proj = _output(self.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp, stored)

    def forward(self, x: torch.Tensor, impl: str = "reference") -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), impl, check=ops.CHECK_MODEL_CALLS))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None, stored: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, tp, stored)
        self.mlp = MLP(cfg, tp, stored)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def weights(self) -> DecoderLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        return DecoderLayerWeights(
            self.input_layernorm.weight, _weight(attn.qkv_proj), attn.qkv_proj.bias, q_norm, k_norm,
            _weight(attn.o_proj), attn.o_proj.bias, self.post_attention_layernorm.weight, _weight(mlp.gate_up_proj),
            mlp.gate_up_proj.bias, _weight(mlp.down_proj), mlp.down_proj.bias)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: StepInputs,
                cache: StaticKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream after this layer's attention, this layer's MLP output). The MLP
        output is added by the next norm, fused with it where the step kernels run; delta is the
        previous layer's MLP output (None for the first layer)."""
        x, h = self.input_layernorm.add_and_norm(x, delta, step.impl)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, step, cache), step.impl)
        return x, self.mlp(h, step.impl)


def _weight(projection: nn.Module):
    """A projection's matrix: a dense weight tensor, or a BlockMatrix as stored."""
    return projection.matrix if isinstance(projection, HoldsBlockMatrix) else projection.weight


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_rows: int, tp: TensorParallel | None = None, stored: bool = False):
        super().__init__()
        self.embed_tokens = BlockEmbedding(vocab_rows, cfg.hidden_size) if stored else nn.Embedding(
            vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, stored) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(RunsOnBackend, KeepsParameterViews):
    is_encoder_decoder = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, stored_matrices: bool = False):
        """stored_matrices: the matrices are kept as a GGUF file stores them (layers.blocks), filled
        by the loader with set_parts; otherwise dense parameters."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.stored_matrices = stored_matrices
        if stored_matrices and (tp is not None or cfg.output_vocab_size is not None):
            raise ValueError("matrices kept as a GGUF file stores them run unsplit and with a full-vocabulary head "
                             "(convert the file to a folder for tensor parallelism: specengine convert)")
        # Split by vocabulary over the ranks: ids [vocab_start, vocab_start + vocab_held) in the
        # first rows of each rank's embedding and head (vocab_rows rows, the rest zero).
        self.vocab_start, self.vocab_held, vocab_rows = 0, cfg.vocab_size, cfg.vocab_size
        if tp is not None:
            if cfg.output_vocab_size is not None:
                raise TensorParallelError("tensor parallelism does not split a head over lm_head.token_ids "
                                          "(a draft's head; drafts are replicated, not split)")
            self.vocab_start, self.vocab_held, vocab_rows = tp.vocab_range(cfg.vocab_size)
        self.model = Backbone(cfg, vocab_rows, tp, stored_matrices)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's
        if stored_matrices:
            self.lm_head = TiedBlockHead(self.model.embed_tokens) if cfg.tie_word_embeddings else BlockLinear(
                cfg.hidden_size, vocab_rows, bias=False)
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.output_vocab_size or vocab_rows, bias=False)
            if cfg.output_vocab_size is not None:
                # The head's rows score these ids (a tied head's rows are copied from the embedding
                # once loaded, see gather_output_rows).
                self.register_buffer("output_token_ids", torch.zeros(cfg.output_vocab_size, dtype=torch.int64))
            elif cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        # The layers whose input states every forward captures (capture_features), and the last
        # whole forward's capture.
        self.feature_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None
        # Kept out of the module's buffers so that model.to(bfloat16) cannot round it.
        self._inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope_at
        # Which ops run (C++ whole layers, C++ ops, Triton, torch): see models.backend. The
        # loader chooses again once the matrices have their storage dtype.
        self.use_backend()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight a Hugging Face checkpoint of this model holds, by its name there, as the
        tensor (or rows of a packed tensor) it loads into. With tied embeddings, lm_head.weight
        is the embedding itself."""
        tensors = dict(self.named_parameters(remove_duplicate=False))
        if self.config.output_vocab_size is not None:
            tensors["lm_head.token_ids"] = self.output_token_ids
            if self.config.tie_word_embeddings:
                del tensors["lm_head.weight"]  # gathered from the embedding, see gather_output_rows
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
            # packed parameter -> (checkpoint name of its rows, first row, row count)
            packed = {"self_attn.qkv_proj": [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, kv),
                                             ("self_attn.v_proj", q + kv, kv)],
                      "mlp.gate_up_proj": [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, inter)]}
            for packed_name, parts in packed.items():
                for kind in ("weight", "bias"):
                    full = tensors.pop(f"model.layers.{i}.{packed_name}.{kind}", None)
                    for name, start, rows in parts if full is not None else ():
                        tensors[f"model.layers.{i}.{name}.{kind}"] = full.narrow(0, start, rows)
        if self.tp is not None and self.vocab_held != self.model.embed_tokens.weight.shape[0]:  # the last rank
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in tensors:
                    tensors[name] = tensors[name].narrow(0, 0, self.vocab_held)
        return tensors

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int, int]]:
        """Split across ranks: checkpoint name -> (dim, start, length, the checkpoint's full size
        in dim) of the part this rank holds. Names not listed are read whole."""
        tp, c = self.tp, self.config
        if tp is None:
            return {}
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        r, n = tp.rank, tp.world_size
        parts = {name: (0, self.vocab_start, self.vocab_held, c.vocab_size)
                 for name in ("model.embed_tokens.weight", "lm_head.weight")}
        for i in range(c.num_layers):
            prefix = f"model.layers.{i}."
            for name, dim, size in (("self_attn.q_proj", 0, q), ("self_attn.k_proj", 0, kv),
                                    ("self_attn.v_proj", 0, kv), ("mlp.gate_proj", 0, inter),
                                    ("mlp.up_proj", 0, inter), ("self_attn.o_proj", 1, q), ("mlp.down_proj", 1, inter)):
                parts[prefix + name + ".weight"] = (dim, r * size, size, n * size)
                if dim == 0:  # column-parallel: the bias splits with the rows (row-parallel: whole)
                    parts[prefix + name + ".bias"] = (0, r * size, size, n * size)
        return parts

    def stored_matrix_sources(self) -> dict[str, list[str]]:
        """A stored-matrix model's matrices: module name -> the checkpoint names of its parts, in row
        order (a packed projection's parts are its checkpoint matrices). Empty for a dense model."""
        if not self.stored_matrices:
            return {}
        sources = {"model.embed_tokens": ["model.embed_tokens.weight"]}
        if not self.config.tie_word_embeddings:
            sources["lm_head"] = ["lm_head.weight"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            sources[p + "self_attn.qkv_proj"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            sources[p + "self_attn.o_proj"] = [p + "self_attn.o_proj.weight"]
            sources[p + "mlp.gate_up_proj"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            sources[p + "mlp.down_proj"] = [p + "mlp.down_proj.weight"]
        return sources

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, KV cache and norms. Matrices may be stored narrower
        (bfloat16 weights with float32 compute on a CPU, see models.loader)."""
        return self.model.norm.weight.dtype

    def new_cache(self, batch_size: int, capacity: int, growable: bool = True) -> StaticKVCache:
        c = self.config
        return StaticKVCache(c.num_layers, batch_size, capacity, self.num_kv_heads, c.head_dim, self.dtype,
                             self.device, growable)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: StaticKVCache,
                kv_len: int | None = None) -> torch.Tensor:
        """Hidden states [B, T, D] after the final norm.

        tokens [B, T] int64; start_pos [B] int64, the position of each row's first token
        (normally its cache length). kv_len, if given, must be max(start_pos) + T: the host
        usually knows it, and passing it avoids a device sync.
        """
        return self.forward_layers(self.start_forward(tokens, start_pos, kv_len), cache)

    def capture_features(self, layer_ids: tuple[int, ...]):
        """From now on every forward captures the residual stream entering each of these decoder
        layers (id i: the input of layer i, the embedding for 0; id num_layers: the output of the
        last layer before the final norm), what a feature drafter reads (drafters.eagle3): after a
        forward has run its last layer, self.features is [B, T, len(layer_ids) * D] float32, the
        states side by side in the order of layer_ids (a PartialForward's are in run.features).
        Set once, when a drafter that reads them is attached; () captures nothing."""
        layer_ids = tuple(layer_ids)
        L = self.config.num_layers
        bad = [i for i in layer_ids if not (isinstance(i, int) and 0 <= i <= L)]
        if bad or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"feature layers must be distinct layer ids in [0, {L}] (the target has {L} layers), "
                             f"got {list(layer_ids)}")
        self.feature_layers, self.features = layer_ids, None

    def start_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor,
                      kv_len: int | None = None) -> "PartialForward":
        """A forward over no layer yet (arguments as forward's), for forward_layers to run."""
        positions = start_pos[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        return PartialForward(tokens, positions, kv_len)

    def forward_layers(self, run: "PartialForward", cache: StaticKVCache, layers: int | None = None) -> torch.Tensor | None:
        """Run the next `layers` decoder layers of `run` (None: those left), writing their keys and
        values into the cache's rows. Returns the hidden states [B, T, D] after the final norm once
        the last layer has run, else None. Between two calls the cache may have moved or grown (its
        rows' entries kept) but its rows must be the same requests'."""
        return self.run_on_backend(self._forward_layers, run, cache, layers)

    def _forward_layers(self, run: "PartialForward", cache: StaticKVCache, layers: int | None,
                        backend: Backend) -> torch.Tensor | None:
        T, c = run.tokens.shape[1], self.config
        kv_len = min(run.kv_len, cache.capacity)
        # Real tokens sit below the capacity; padding starts at most at it (the spill slot).
        cos, sin = self.rope_at(run.positions, cache.capacity + T)
        # Each query sees keys at or before its own position: the row's valid prefix plus the
        # tokens of this call; stale entries of rolled-back drafts lie beyond and stay hidden.
        mask = attention_mask(run.positions, kv_len, c.sliding_window) if backend.impl == "reference" else None
        step = StepInputs(run.positions, cos, sin, kv_len, backend.impl, mask)
        # A prefill-sized call runs op by op, its products GEMMs (see ops.product).
        whole_layers = self.whole_layer_weights() if backend.whole_layers and not gemm_sized(T) else None
        # The embedding is made here, not kept from an earlier failed try (models.backend's fallback).
        x, delta = (self.embed(run.tokens), None) if run.layers_done == 0 else (run.x, run.delta)
        end = len(self.model.layers) if layers is None else min(len(self.model.layers), run.layers_done + layers)
        capture = self.feature_layers
        if capture and run.features is None:
            run.features = torch.empty((*run.tokens.shape, len(capture) * c.hidden_size), dtype=torch.float32,
                                       device=run.tokens.device)
        for i in range(run.layers_done, end):
            if i in capture:
                self._capture(run.features, capture.index(i), x, delta)
            if whole_layers is not None:  # one C++ call, x updated in place
                decoder_layer(x, whole_layers[i], c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, cos, sin,
                              run.positions, *cache.layer(i), kv_len, c.sliding_window, check=ops.CHECK_MODEL_CALLS)
            else:
                x, delta = self.model.layers[i](x, delta, step, cache)
        run.x, run.delta, run.layers_done = x, delta, end
        if end < len(self.model.layers):
            return None
        if capture:
            if len(self.model.layers) in capture:
                self._capture(run.features, capture.index(len(self.model.layers)), x, delta)
            self.features = run.features
        return self.model.norm.add_and_norm(x, delta, backend.impl)[1]

    def _capture(self, features: torch.Tensor, slot: int, x: torch.Tensor, delta: torch.Tensor | None):
        """Write the residual stream into features[..., slot * D:(slot + 1) * D]: x + delta on the
        per-op paths (the add the next norm makes), x itself where whole layers update it in place
        (copied before the next layer overwrites it)."""
        D = self.config.hidden_size
        features[..., slot * D:(slot + 1) * D].copy_(x if delta is None else x + delta)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, D] in the compute dtype, a fresh tensor (indexing copies; the
        whole-layer op updates it in place). Indexed, not through nn.Embedding's module call, whose
        overhead is a visible share of a small draft's step (measured:
        bench/results/host-overheads-2026-11-29-to-12-03.md). Split by vocabulary, each rank looks
        up the ids it holds, zeros for the others, and an all-reduce sums them."""
        if self.stored_matrices:
            return self.model.embed_tokens(tokens).to(self.dtype)
        weight = self.model.embed_tokens.weight
        if self.tp is None:
            return weight[tokens].to(self.dtype)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_held)
        x = weight[local.masked_fill(outside, 0)].to(self.dtype).masked_fill_(outside[..., None], 0.0)
        return self.tp.all_reduce_(x)

    def rope_at(self, positions: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos, sin [B, T, head_dim] at positions [B, T], all below limit. On a CPU they
        are rows of a table of positions 0..n-1 that rope_cos_sin built (grown by doubling as
        limits grow): computing them every call is a visible share of a small draft's step there
        (measured: bench/results/host-overheads-2026-11-29-to-12-03.md). On a GPU they are
        computed: a few kernels, and replayed ones under CUDA graphs."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        if positions.device.type != "cpu":
            return rope_cos_sin(self._inv_freq, positions, self.dtype)
        table = self._rope_table
        if table is None or table[0].shape[0] < limit or table[0].dtype != self.dtype:
            rows = max(256, 1 << (limit - 1).bit_length())
            cos, sin = rope_cos_sin(self._inv_freq, torch.arange(rows)[None], self.dtype)
            self._rope_table = table = (cos[0], sin[0])
        return table[0][positions], table[1][positions]

    def whole_layer_weights(self) -> list[DecoderLayerWeights] | None:
        """Each decoder layer's weights for ops.decoder_layer, or None unless every matrix is stored
        in bfloat16 or kept as a GGUF file stores it (the "cpp-layers" backend's condition). Kept
        between calls: replacing a layer's parameter, or moving or casting the model with parameters
        swapped for new objects, rebuilds them."""
        if self.stored_matrices:  # None until the loader has filled every matrix (set_parts renews the views)
            return self.parameter_views(lambda: [layer.weights() for layer in self.model.layers] if all(
                m.weight_types for m in self.modules() if isinstance(m, HoldsBlockMatrix)) else None)
        weights = self.parameter_views(lambda: [layer.weights() for layer in self.model.layers])
        bf16 = torch.bfloat16
        if all(w.qkv.dtype == bf16 and w.o.dtype == bf16 and w.gate_up.dtype == bf16 and w.down.dtype == bf16
               for w in weights):
            return weights
        return None

    def gather_output_rows(self):
        """A tied head over output_token_ids: its rows are the embedding's rows of those ids."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self.model.embed_tokens.weight[self.output_token_ids])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] in float32 for hidden states [..., D] (-inf on ids outside
        output_token_ids, where the head has them)."""
        scores = self.lm_head(hidden).float()
        if self.tp is not None:
            return self.tp.gather_vocab(scores, self.config.vocab_size)
        if self.config.output_vocab_size is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.output_token_ids, scores)
