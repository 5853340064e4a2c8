"""T5 encoder-decoder (T5ForConditionalGeneration): original T5 (ReLU) and v1.1 / Flan-T5 (gated GELU).

To the engine it is a decoder like LlamaForCausalLM: forward(tokens [B, T], start_pos [B],
cache, kv_len) -> hidden [B, T, D] on a static self-attention cache, and logits(hidden). What it
adds is encode(cache, sources): run the encoder once over each joining row's input and write the
cross-attention keys and values of every decoder layer into that row of the cache
(layers.kv_cache.EncoderDecoderKVCache); each decoding step only reads them.

Positions are relative: a learned bias per (head, bucket of key - query), in the first block of
each stack and shared by the rest, added to the unscaled q.k scores. The decoder's bias depends
only on the distance back, so a table over distances is built once (grown by doubling) and each
forward gathers from it at its rows' own positions. Module names are ours; checkpoint_tensors
maps transformers' names onto them (q/k/v and wi_0/wi_1 packed into one matrix each, as in llama.py).

The backend (models.backend) is chosen once per model: on a CPU in float32 the norms and
attentions are C++ ops (ops.norm, ops.attention's relative_attention: "cpp-ops"); with
bfloat16-stored matrices each decoder block of a decoding step is one C++ call
(ops.decoder_layer.t5_decoder_block: "cpp-layers"). Elsewhere (CUDA, float16/bfloat16 compute)
"torch" runs: the same arithmetic, and the oracle of the C++ ops in the tests. T5 has no Triton path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..layers.kv_cache import EncoderDecoderKVCache
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.tracked import KeepsParameterViews
from ..ops.attention import biased_attention, relative_attention, relative_bias
from ..ops.decoder_layer import T5BlockWeights, t5_decoder_block
from ..ops.product import gemm_sized
from .backend import Backend, RunsOnBackend
from .t5_config import T5Config


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each key - query offset: exact below half the buckets, logarithmic up to
    max_distance, the last bucket beyond; bidirectional gives each sign half the buckets."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class FeedForward(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.d_ff, self.gated, self.activation = cfg.d_ff, cfg.gated, cfg.activation
        # wi_0 and wi_1 in one matrix when gated (checkpoint_tensors maps them onto its rows).
        self.wi = Linear(cfg.d_model, (2 if cfg.gated else 1) * cfg.d_ff, bias=False)
        self.wo = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu":
            return F.relu(x)
        if self.activation == "gelu_new":
            return F.gelu(x, approximate="tanh")
        if self.activation == "gelu":
            return F.gelu(x)
        return F.silu(x)

    def forward(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        h = self.wi(self.norm(x, impl))
        if self.gated:
            gate, up = h.split(self.d_ff, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.wo(h)


class SelfAttention(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.num_heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.inner = cfg.num_heads * cfg.d_kv
        self.qkv = Linear(cfg.d_model, 3 * self.inner, bias=False)
        self.o = Linear(self.inner, cfg.d_model, bias=False)

    def project(self, x: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm(x, impl)).view(B, T, 3, self.num_heads, self.d_kv).unbind(2)
        return q, k, v


class CrossAttention(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.num_heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.inner = cfg.num_heads * cfg.d_kv
        self.q = Linear(cfg.d_model, self.inner, bias=False)
        self.kv = Linear(cfg.d_model, 2 * self.inner, bias=False)
        self.o = Linear(self.inner, cfg.d_model, bias=False)


class EncoderBlock(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ff = FeedForward(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, impl: str) -> torch.Tensor:
        q, k, v = self.attn.project(x, impl)
        x = x + self.attn.o(biased_attention(q, k, v, bias))  # (torch on every backend)
        return self.ff(x, impl)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: T5Config, index: int):
        super().__init__()
        self.index = index
        self.attn = SelfAttention(cfg)
        self.cross = CrossAttention(cfg)
        self.ff = FeedForward(cfg)

    def forward(self, x: torch.Tensor, step: "DecoderStep", cache: EncoderDecoderKVCache) -> torch.Tensor:
        B, T, _ = x.shape
        impl, check = step.impl, ops.CHECK_MODEL_CALLS
        q, k, v = self.attn.project(x, impl)
        cache_k, cache_v = cache.layer(self.index)
        cross = self.cross
        cross_k, cross_v = cache.cross_layer(self.index)
        # The self-attention writes the new tokens' K/V at their positions before it reads.
        x = x + self.attn.o(relative_attention(q, k, v, step.positions, cache_k, cache_v, step.kv_len, step.bias_table,
                                               impl, bias=step.self_bias, check=check))
        q = cross.q(cross.norm(x, impl)).view(B, T, cross.num_heads, cross.d_kv)
        x = x + cross.o(relative_attention(q, None, None, step.source_last, cross_k, cross_v, cache.source_capacity,
                                           None, impl, bias=step.cross_bias, check=check))
        return self.ff(x, impl)


@dataclass
class EncoderRun:
    """An encoder pass in progress (T5ForConditionalGeneration.start_encoding)."""

    tokens: torch.Tensor   # [B, S] int64, right-padded inputs
    lengths: torch.Tensor  # [B] int64
    bias: torch.Tensor     # [B, H, S, S] relative position bias, -inf on padding keys
    x: torch.Tensor        # [B, S, D] the hidden states after blocks_done blocks
    impl: str              # the ops' implementation (models.backend), chosen at the start
    blocks_done: int = 0


@dataclass
class DecoderStep:
    """What every decoder block of one forward shares."""

    positions: torch.Tensor    # [B, T] int64, each new token's position
    kv_len: int                # self-attention keys a query may see (max position + 1, within capacity)
    source_last: torch.Tensor  # [B, T] int64, each row's last encoder token (the cross-attention's "position")
    impl: str                  # the ops' implementation: "cpp" or "reference" (models.backend)
    bias_table: torch.Tensor   # [n > max position, H]: the decoder's bias of a key d positions back
    # The reference attentions' additive biases from ops.attention's relative_bias, built once per
    # forward: [B, H, T, kv_len] and [B, 1, T, source capacity] (None for "cpp", which reads the table).
    self_bias: torch.Tensor | None = None
    cross_bias: torch.Tensor | None = None


class T5ForConditionalGeneration(RunsOnBackend, KeepsParameterViews):
    is_encoder_decoder = True
    tp = None  # never split (layers.parallel covers the decoder-only models)
    SUPPORTED_BACKENDS = ("cpp-layers", "cpp-ops", "torch")

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        buckets = cfg.relative_attention_num_buckets
        # The relative biases are not matrices: held in the compute dtype (the loader narrows
        # only Linear and Embedding weights).
        self.encoder_bias = nn.Parameter(torch.zeros(buckets, cfg.num_heads))
        self.decoder_bias = nn.Parameter(torch.zeros(buckets, cfg.num_heads))
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.encoder_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.decoder = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.num_decoder_layers))
        self.decoder_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        # Its own weight until a checkpoint without lm_head.weight ties it (finish_load).
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._distance_bias: tuple[tuple, torch.Tensor] | None = None  # see decoder_distance_bias
        # Which ops run (C++ whole blocks, C++ ops, torch): see models.backend. The loader
        # chooses again once the matrices have their storage dtype.
        self.use_backend()

    # ---- checkpoints -------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight a transformers T5 checkpoint holds, by its name there, as the tensor (or
        rows of a packed tensor) it loads into."""
        out = {"shared.weight": self.shared.weight, "lm_head.weight": self.lm_head.weight,
               "encoder.embed_tokens.weight": self.shared.weight, "decoder.embed_tokens.weight": self.shared.weight,
               "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": self.encoder_bias,
               "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": self.decoder_bias,
               "encoder.final_layer_norm.weight": self.encoder_norm.weight,
               "decoder.final_layer_norm.weight": self.decoder_norm.weight}
        def rows(weight, names):
            return {name: weight.narrow(0, i * weight.shape[0] // len(names), weight.shape[0] // len(names))
                    for i, name in enumerate(names)}

        def feed_forward(prefix, ff):
            wi = rows(ff.wi.weight, [f"{prefix}.DenseReluDense.wi_0.weight", f"{prefix}.DenseReluDense.wi_1.weight"]
                      ) if ff.gated else {f"{prefix}.DenseReluDense.wi.weight": ff.wi.weight}
            return {**wi, f"{prefix}.DenseReluDense.wo.weight": ff.wo.weight, f"{prefix}.layer_norm.weight": ff.norm.weight}

        for stack, blocks in (("encoder", self.encoder), ("decoder", self.decoder)):
            for i, block in enumerate(blocks):
                p = f"{stack}.block.{i}.layer"
                out.update(rows(block.attn.qkv.weight, [f"{p}.0.SelfAttention.{n}.weight" for n in "qkv"]))
                out[f"{p}.0.SelfAttention.o.weight"] = block.attn.o.weight
                out[f"{p}.0.layer_norm.weight"] = block.attn.norm.weight
                if stack == "decoder":
                    out[f"{p}.1.EncDecAttention.q.weight"] = block.cross.q.weight
                    out.update(rows(block.cross.kv.weight, [f"{p}.1.EncDecAttention.{n}.weight" for n in "kv"]))
                    out[f"{p}.1.EncDecAttention.o.weight"] = block.cross.o.weight
                    out[f"{p}.1.layer_norm.weight"] = block.cross.norm.weight
                out.update(feed_forward(f"{p}.{2 if stack == 'decoder' else 1}", block.ff))
        return out

    # Names a checkpoint may leave out: the stacks' embeddings are copies of shared.weight (one
    # is enough), and without lm_head.weight the head is tied to it.
    OPTIONAL_CHECKPOINT_TENSORS = frozenset({"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                                             "lm_head.weight"})

    def checkpoint_slices(self) -> dict:
        return {}

    def finish_load(self, loaded: set[str]):
        """After the loader copied the checkpoint's tensors: tie a head the checkpoint lacks."""
        if "lm_head.weight" not in loaded:
            self.lm_head.weight = self.shared.weight

    @property
    def head_is_tied(self) -> bool:
        return self.lm_head.weight is self.shared.weight

    @property
    def device(self) -> torch.device:
        return self.decoder_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (matrices may be stored in bfloat16 on a CPU, see models.loader)."""
        return self.decoder_norm.weight.dtype

    def new_cache(self, batch_size: int, capacity: int, growable: bool = True) -> EncoderDecoderKVCache:
        c = self.config
        return EncoderDecoderKVCache(c.num_decoder_layers, batch_size, capacity, c.num_heads, c.d_kv, self.dtype,
                                     self.device, growable)

    # ---- the encoder ------------------------------------------------------------------------

    def encode(self, cache: EncoderDecoderKVCache, sources: list[list[int]]):
        """Run the encoder over sources[b] (its input ids) and write row b's cross-attention keys and
        values of every decoder layer into the cache (rows in use, as many as sources). Sources
        may differ in length: each row attends only to its own tokens."""
        if len(sources) != cache.batch_size:
            raise ValueError(f"{len(sources)} encoder inputs for a cache of {cache.batch_size} rows")
        run = self.start_encoding(sources)
        self.encode_blocks(run, len(self.encoder))
        self.finish_encoding(run, cache)

    def start_encoding(self, sources: list[list[int]]) -> "EncoderRun":
        """An encoder pass over these inputs (right-padded), run a few blocks at a time by
        encode_blocks and written into a cache by finish_encoding: encode() in steps, for a prefill
        spread over steps. The arithmetic is encode()'s, in the same order."""
        longest = max(len(s) for s in sources)
        device = self.device
        tokens = torch.tensor([s + [0] * (longest - len(s)) for s in sources], dtype=torch.int64, device=device)
        lengths = torch.tensor([len(s) for s in sources], dtype=torch.int64, device=device)
        return self.run_on_backend(self._start_encoding, tokens, lengths)

    def encode_blocks(self, run: "EncoderRun", count: int) -> bool:
        """Run up to `count` more encoder blocks; whether all have run."""
        for block in self.encoder[run.blocks_done:run.blocks_done + count]:
            run.x = block(run.x, run.bias, run.impl)
            run.blocks_done += 1
        return run.blocks_done == len(self.encoder)

    def finish_encoding(self, run: "EncoderRun", cache: EncoderDecoderKVCache):
        """The encoder's output (every block run) as each decoder layer's cross-attention keys and
        values in the cache's rows in use (as many as the run's inputs)."""
        hidden = self.encoder_norm(run.x, run.impl)  # [B, S, D]
        (B, S), lengths = run.tokens.shape, run.lengths
        cache.reserve_source(S)  # a view of joining rows already has room (the caller reserved)
        for block in self.decoder:
            k, v = block.cross.kv(hidden).view(B, S, 2, block.cross.num_heads, block.cross.d_kv).unbind(2)
            cross_k, cross_v = cache.cross_layer(block.index)
            cross_k[:B, :S] = k
            cross_v[:B, :S] = v
        cache.source_lengths.copy_(lengths)

    def encoder_hidden(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The encoder's output [B, S, D] for right-padded tokens [B, S] of these lengths [B]."""
        run = self.run_on_backend(self._start_encoding, tokens, lengths)
        self.encode_blocks(run, len(self.encoder))
        return self.encoder_norm(run.x, run.impl)

    def _start_encoding(self, tokens: torch.Tensor, lengths: torch.Tensor, backend: Backend) -> "EncoderRun":
        S, c = tokens.shape[1], self.config
        offsets = torch.arange(S, device=tokens.device)
        buckets = relative_position_bucket(offsets[None, :] - offsets[:, None], True,
                                           c.relative_attention_num_buckets, c.relative_attention_max_distance)
        bias = self.encoder_bias[buckets].permute(2, 0, 1)[None]  # [1, H, S, S]
        padding = offsets[None, :] >= lengths[:, None]  # [B, S] keys past each row's input
        bias = bias.masked_fill(padding[:, None, None, :], float("-inf"))  # [B, H, S, S]
        return EncoderRun(tokens, lengths, bias, self.shared.weight[tokens].to(self.dtype), backend.impl)

    # ---- the decoder ------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: EncoderDecoderKVCache,
                kv_len: int | None = None) -> torch.Tensor:
        """Decoder hidden states [B, T, D] after the final norm. tokens [B, T] int64 at per-row start
        positions start_pos [B] int64 (normally the cache lengths); kv_len, if given, is
        max(start_pos) + T (known on the host: passing it avoids a device sync)."""
        positions = start_pos[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        kv_len = min(kv_len, cache.capacity)
        return self.run_on_backend(self._forward, tokens, positions, cache, kv_len)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: EncoderDecoderKVCache, kv_len: int,
                 backend: Backend) -> torch.Tensor:
        (B, T), c = tokens.shape, self.config
        table = self.decoder_distance_bias(cache.capacity + T)
        source_last = (cache.source_lengths - 1)[:, None].expand(B, T).contiguous()
        step = DecoderStep(positions, kv_len, source_last, backend.impl, table)
        if backend.impl == "reference":
            step.self_bias = relative_bias(positions, kv_len, table, self.dtype)
            step.cross_bias = relative_bias(source_last, cache.source_capacity, None, self.dtype)
        # A prefill-sized call runs op by op, its products GEMMs (see ops.product).
        whole_blocks = self.whole_layer_weights() if backend.whole_layers and not gemm_sized(T) else None
        x = self.shared.weight[tokens].to(self.dtype)
        for i, block in enumerate(self.decoder):
            if whole_blocks is not None:  # one C++ call, x updated in place
                t5_decoder_block(x, whole_blocks[i], c.num_heads, c.d_kv, c.activation, c.gated, c.layer_norm_epsilon,
                                 positions, *cache.layer(i), kv_len, table, source_last, *cache.cross_layer(i),
                                 check=ops.CHECK_MODEL_CALLS)
            else:
                x = block(x, step, cache)
        return self.decoder_norm(x, backend.impl)

    def whole_layer_weights(self) -> list[T5BlockWeights] | None:
        """Each decoder block's weights for ops.decoder_layer.t5_decoder_block, or None unless every
        matrix is stored in bfloat16 (the "cpp-layers" backend's condition). Kept between calls
        (rebuilt when a parameter is replaced)."""
        weights = self.parameter_views(lambda: [
            T5BlockWeights(b.attn.norm.weight, b.attn.qkv.weight, b.attn.o.weight, b.cross.norm.weight,
                           b.cross.q.weight, b.cross.o.weight, b.ff.norm.weight, b.ff.wi.weight, b.ff.wo.weight)
            for b in self.decoder])
        if all(t.dtype == torch.bfloat16 for w in weights for t in (w.qkv, w.self_o, w.cross_q, w.cross_o, w.wi, w.wo)):
            return weights
        return None

    def decoder_distance_bias(self, limit: int) -> torch.Tensor:
        """[n >= limit, H]: the decoder's bias for a key `d` positions before its query. Rebuilt
        (doubling) when a longer one is needed, or the bias weights or dtype changed."""
        weight = self.decoder_bias
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._distance_bias is None or self._distance_bias[0] != key or self._distance_bias[1].shape[0] < limit:
            n = max(256, 1 << (limit - 1).bit_length())
            c = self.config
            buckets = relative_position_bucket(-torch.arange(n, device=weight.device), False,
                                               c.relative_attention_num_buckets, c.relative_attention_max_distance)
            self._distance_bias = (key, weight.detach()[buckets])
        return self._distance_bias[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] in float32 for decoder hidden states [..., D]."""
        if self.config.scale_decoder_outputs:
            hidden = hidden * (self.config.d_model ** -0.5)
        return self.lm_head(hidden).float()
