"""The decoder-only models (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Cohere2, and QWen
read as Qwen2: model_factory/qwen.py) over a paged KV cache, built from and running their layer plan
(model_factory/plan.py), the mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss), whose
sparse layers' MLP is model_factory/moe.py's, and the Gated DeltaNet hybrids (Qwen3-Next, its
MLP a mixture too, and Qwen3.5), whose linear-attention layers are recurrent layers
(model_factory/gated_delta.py) with their state in a StatePool (model_factory/recurrent.py), and
the Mamba2 hybrid Granite 4.0-H, whose Mamba2 layers are recurrent layers too
(model_factory/mamba2.py; its config and names: model_factory/granite.py).

Parameter names follow the Hugging Face checkpoints so a state dict loads as is; `fuse()` then
concatenates q/k/v and gate/up projections so each layer runs two fewer matmuls.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rtpkv.kernels import (AttentionBackend, AttentionBatch, apply_rope_, attention_backend,
                           rms_norm, rope_table, silu_and_mul)
from rtpkv.kernels import weight_types
from rtpkv.kernels.activation import (clamped_swiglu, clamped_swiglu_and_mul, gelu_tanh_and_mul,
                                     soft_cap)
from rtpkv.kernels.norm import layer_norm_no_bias, rms_norm_float_weight
from rtpkv.kernels.fused_decoder import FusedDecoder, kernel_weights
from rtpkv.kernels.gated_delta import sigmoid_gate_
from rtpkv.kernels.huge_pages import into_huge_pages
from rtpkv.kernels.linear import InferenceLinear, linear_path
from rtpkv.model_factory.gated_delta import INTERLEAVED_ARCHITECTURES, GatedDeltaNet
from rtpkv.model_factory.moe import CLAMPED_SWIGLU_EXPERTS, SparseMoe
from rtpkv.model_factory.mamba2 import Mamba2Mixer
from rtpkv.model_factory.plan import (GATED_DELTA, GLOBAL_ROPE, MAMBA2, LayerPlan, ModelPlan,
                                      NormPlan, capped_window, model_plan)
from rtpkv.model_factory.recurrent import RecurrentBatch, StateSpec
from rtpkv.model_factory.spec import ModelSpec

log = logging.getLogger("rtpkv")


class RMSNorm(nn.Module):
    """The plan's norm: Llama's RMSNorm, Gemma's (1 + w) one (`plan.offset`), or Cohere's
    LayerNorm without bias (`plan.centered`), under the checkpoints' one weight name."""

    def __init__(self, dim: int, plan: NormPlan):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = plan.eps
        self.offset = plan.offset
        self.centered = plan.centered   # Cohere's LayerNorm without bias
        self.scale: Optional[torch.Tensor] = None   # an offset norm's (1 + w) in float32

    def prepare(self) -> None:
        """After loading: an offset norm's float32 (1 + w), computed as transformers does."""
        if self.offset:
            self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """With `residual`: normalizes residual + x, stored into `residual`."""
        if self.centered:
            return layer_norm_no_bias(x, self.weight, self.eps, residual)
        if self.offset:
            return rms_norm_float_weight(x, self.scale, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)


_ACTIVATIONS = {"silu": (silu_and_mul, F.silu),
                "gelu_tanh": (gelu_tanh_and_mul, lambda x: F.gelu(x, approximate="tanh"))}


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, plan: LayerPlan):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        attention = plan.attention
        self.output_gate = attention.output_gate   # q_proj computes a gate beside each head
        self.q_out = self.q_size * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(spec.hidden_size, self.q_out, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.kv_size, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        if attention.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, plan.norm)
            self.k_norm = RMSNorm(spec.head_dim, plan.norm)
        self.qk_norm = attention.qk_norm
        self.scale = attention.scale
        self.softcap = attention.softcap
        self.rope = attention.rope
        if attention.sinks:   # gpt-oss: one logit per query head
            self.sinks = nn.Parameter(torch.empty(spec.num_heads))
        self.has_sinks = attention.sinks
        self.qkv: Optional[nn.Linear] = None

    def fuse(self) -> None:
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, self.q_out + 2 * self.kv_size, bias=q.bias is not None,
                          device=q.weight.device, dtype=q.weight.dtype)
        fused.weight.data = torch.cat([q.weight, k.weight, v.weight])
        if q.bias is not None:
            fused.bias.data = torch.cat([q.bias, k.bias, v.bias])
        self.qkv = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                kv: tuple[torch.Tensor, torch.Tensor], meta: Any,
                attention: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([self.q_out, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.output_gate:   # per head: the query, then its gate
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:   # None: a layer without positional encoding (Cohere2's full
            rotary = rope[0].shape[-1]   # layers, Granite 4.0-H's where its config says so)
            if rotary == self.head_dim:
                apply_rope_(q, k, rope[0], rope[1], positions)
            else:   # partial RoPE: the first `rotary` dimensions of each head, in place
                apply_rope_(q[..., :rotary], k[..., :rotary], rope[0], rope[1], positions)
        extra: dict[str, Any] = {}   # what only some backends do (attention_backend picks one)
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if self.has_sinks:
            extra["sinks"] = self.sinks
        out = attention.forward(q, k, v, kv[0], kv[1], meta, self.scale, **extra)
        if gate is not None:
            out = sigmoid_gate_(out.reshape(t, self.num_heads, self.head_dim).contiguous(), gate)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: Optional[int] = None,
                 kind: str = "silu", bias: bool = False):
        """`intermediate_size`: an expert's (model_factory/moe.py); the dense MLP's by default.
        `kind`: the layer plan's MLP kind, "silu" (SwiGLU) or "gelu_tanh" (GeGLU), or gpt-oss's
        experts' "clamped_swiglu" (its alpha and limit from the spec's MoeSpec). `bias`: the
        three projections have biases (gpt-oss's experts)."""
        super().__init__()
        inter = intermediate_size or spec.intermediate_size
        self.gate_proj = nn.Linear(spec.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(spec.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=bias)
        self.kind = kind
        if kind == CLAMPED_SWIGLU_EXPERTS:
            self.alpha, self.limit = spec.moe.swiglu_alpha, spec.moe.swiglu_limit
        self.gate_up: Optional[nn.Linear] = None

    def fuse(self) -> None:
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=g.bias is not None,
                          device=g.weight.device, dtype=g.weight.dtype)
        fused.weight.data = torch.cat([g.weight, u.weight])
        if g.bias is not None:
            fused.bias.data = torch.cat([g.bias, u.bias])
        self.gate_up = fused
        del self.gate_proj, self.up_proj

    def convert(self, convert: Callable[[nn.Linear], nn.Module]) -> None:
        """Fuse, then run both projections through `convert` (CausalLM.prepare's)."""
        self.fuse()
        self.gate_up = convert(self.gate_up)
        self.down_proj = convert(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == CLAMPED_SWIGLU_EXPERTS:
            if self.gate_up is not None:
                return self.down_proj(clamped_swiglu_and_mul(self.gate_up(x), self.alpha,
                                                             self.limit))
            return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.alpha,
                                                 self.limit))
        fused, act = _ACTIVATIONS[self.kind]
        if self.gate_up is not None:
            return self.down_proj(fused(self.gate_up(x)))
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama's two norms (`post_attention_layernorm` is its MLP's input norm), or with
    `plan.sandwich` Gemma's four (`post_attention_layernorm` on the attention output,
    `pre_feedforward_layernorm` on the MLP input, `post_feedforward_layernorm` on its output),
    or with `plan.parallel` Cohere's one (attention and MLP both read `input_layernorm`'s
    output; the layer's output is their sum)."""

    def __init__(self, spec: ModelSpec, index: int, plan: LayerPlan):
        super().__init__()
        self.recurrent = plan.recurrent
        self.residual_scale = plan.residual_scale
        if plan.mixer == GATED_DELTA:
            self.linear_attn = GatedDeltaNet(spec.hidden_size, spec.linear_attention,
                                             spec.rms_norm_eps,
                                             spec.architecture in INTERLEAVED_ARCHITECTURES)
        elif plan.mixer == MAMBA2:
            self.mamba = Mamba2Mixer(spec.hidden_size, spec.mamba, spec.rms_norm_eps)
        else:
            self.self_attn = Attention(spec, plan)
        self.mlp: nn.Module = (
            SparseMoe(spec.hidden_size, spec.moe,
                      partial(MLP, spec, kind=spec.moe.activation, bias=spec.moe.expert_bias))
            if spec.moe is not None and index in spec.moe.sparse_layers
            else MLP(spec, kind=plan.mlp))
        self.sandwich, self.parallel = plan.sandwich, plan.parallel
        self.input_layernorm = RMSNorm(spec.hidden_size, plan.norm)
        if not plan.parallel:
            self.post_attention_layernorm = RMSNorm(spec.hidden_size, plan.norm)
        if plan.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, plan.norm)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, plan.norm)

    @property
    def recurrent_layer(self) -> nn.Module:
        """A recurrent layer's token mixer (model_factory/recurrent.py's RecurrentLayer)."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.mamba

    def forward(self, residual: torch.Tensor, h: Optional[torch.Tensor], positions: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]], kv: Any, meta: Any,
                attention: AttentionBackend) -> torch.Tensor:
        """The layer's output, still to be added to `residual` (the stream, to which the last
        layer's output `h` is added first, in place). A recurrent layer's `kv` is its state
        tensors and its `meta` the RecurrentBatch."""
        x = self.input_layernorm(residual) if h is None else self.input_layernorm(h, residual)
        if self.recurrent:
            h = self.recurrent_layer(x, meta, kv)
        else:
            h = self.self_attn(x, positions, rope, kv, meta, attention)
        if self.parallel:
            return h + self.mlp(x)
        if self.residual_scale is not None:   # Granite: both outputs scaled before their adds
            h = h * self.residual_scale
            return self.mlp(self.post_attention_layernorm(h, residual)) * self.residual_scale
        if not self.sandwich:
            return self.mlp(self.post_attention_layernorm(h, residual))
        x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, plan: ModelPlan):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, layer)
                                    for i, layer in enumerate(plan.layers))
        self.norm = RMSNorm(spec.hidden_size, plan.final_norm)


class CausalLM(nn.Module):
    """Decoder-only LM: `forward` fills the KV pool and returns hidden states; `logits` projects
    only the rows that need sampling."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.plan = model_plan(spec)
        self.model = Backbone(spec, self.plan)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cos: Optional[torch.Tensor] = None    # the global RoPE table (ropes[GLOBAL_ROPE])
        self.sin: Optional[torch.Tensor] = None
        self.ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # the plan's tables
        self.embedding_scale: Optional[torch.Tensor] = None   # in the model's dtype
        self.fused: Optional[FusedDecoder] = None   # the layers as one C call, where they can be

    def prepare(self, max_positions: int, attention: str = "auto", linear: str = "auto",
                weight_quantization: Optional[str] = None,
                kv_dtype: Optional[torch.dtype] = None) -> None:
        """After weights are loaded: tie, fuse, choose the GEMM path (kernels/linear.py; `linear`
        is RTPKV_LINEAR) or convert the linear layers (`weight_quantization`: a WEIGHT_TYPE of
        kernels/weight_types.py),
        build the RoPE table, pick the attention backend (`attention` is RTPKV_ATTENTION) for
        the pool's `kv_dtype` (torch.int8: the int8 KV cache; default: the model's dtype) and,
        where every layer runs on the C kernels, the fused decoder (kernels/fused_decoder.py)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        weight = self.model.embed_tokens.weight
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.prepare()
        if self.plan.embedding_scale is not None:   # as transformers: a float32 scalar, cast
            self.embedding_scale = torch.tensor(self.plan.embedding_scale).to(weight)
        kind = weight_types.REGISTRY[weight_quantization] if weight_quantization else None
        self.linear_path = (kind.layer.path if kind
                            else linear_path(weight.dtype, weight.device, linear))
        freed = 0   # bytes of float weights the quantized layers free

        def convert(layer: nn.Linear, shared: bool = False) -> nn.Module:
            nonlocal freed
            if kind is None:
                return InferenceLinear(layer, self.linear_path)
            if not shared:
                freed += sum(p.numel() * p.element_size() for p in layer.parameters())
            return kind.layer(layer)

        router_path = linear_path(weight.dtype, weight.device, linear)
        for layer in self.model.layers:
            mlp = layer.mlp
            if layer.recurrent:
                layer.recurrent_layer.convert(convert)
            else:
                attn = layer.self_attn
                attn.fuse()
                attn.qkv = convert(attn.qkv)
                attn.o_proj = convert(attn.o_proj)
            if isinstance(mlp, SparseMoe):
                mlp.convert(convert, lambda router: InferenceLinear(router, router_path))
            else:
                mlp.convert(convert)
        tied = self.spec.tie_word_embeddings
        self.lm_head = convert(self.lm_head, shared=tied)
        # every other C-kernel weight in 2 MiB pages before the fused decoder takes their
        # addresses (kernels/huge_pages.py; a mixture's layer moved its own in mlp.convert,
        # before its C call took theirs)
        in_mixtures = {id(m) for moe in self.modules() if isinstance(moe, SparseMoe)
                       for m in moe.modules()}
        into_huge_pages(kernel_weights(m for m in self.modules() if id(m) not in in_mixtures))
        if kind:
            held = sum(m.nbytes for m in self.modules() if isinstance(m, kind.layer))
            log.info("WEIGHT_TYPE=%s: %d linear layers (the LM head included) held as %s: "
                     "%.1f MiB of float32 weights freed, %.1f MiB held (%.1f MiB saved%s); "
                     "embeddings and norms stay float32", kind.name.upper(),
                     sum(isinstance(m, kind.layer) for m in self.modules()), kind.held_as,
                     freed / 2**20, held / 2**20, (freed - held) / 2**20,
                     "; the tied LM head is a copy of the float32 embedding" if tied else "")
        self.ropes = {name: rope_table(self.spec.inv_freq(rope), max_positions, weight.dtype,
                                       weight.device, self.spec.rope_attention_factor(rope))
                      for name, rope in self.plan.ropes.items()}
        self.cos, self.sin = self.ropes[GLOBAL_ROPE]
        self.attention = attention_backend(weight.device, weight.dtype, self.spec.head_dim,
                                           attention, kv_dtype,
                                           softcap=self.plan.softcapped_attention,
                                           sinks=self.plan.attention_sinks)
        self.fused = FusedDecoder.build(self)

    @property
    def attention_name(self) -> str:
        return self.attention.name

    @property
    def state_specs(self) -> list[tuple[StateSpec, ...]]:
        """Each recurrent layer's state tensors, in layer order (empty: no recurrent layer):
        what a StatePool for this model holds."""
        return [layer.recurrent_layer.state_specs() for layer in self.model.layers
                if layer.recurrent]

    def layer_caches(self, kv_caches: list[Any], states: list[list[torch.Tensor]]) -> list[Any]:
        """What each layer reads and writes, in layer order: the next of `kv_caches` (K, V) for
        an attention layer, the next of `states` (a StatePool's tensors) for a recurrent one."""
        kv, state = iter(kv_caches), iter(states)
        return [next(state) if layer.recurrent else next(kv) for layer in self.model.layers]

    def attention_metadata(self, batch: AttentionBatch,
                           layer_batches: Optional[list[AttentionBatch]] = None,
                           recurrent: Optional[RecurrentBatch] = None) -> list[Any]:
        """Each layer's attention metadata for `batch`, or for its own of `layer_batches` (KV
        cache groups: its group's tables, one per attention layer in order); a batch's `window`
        (the engine's, or the group's) caps the layer's own. The backend builds once per
        distinct batch and window, shared by the layers that read it. A recurrent layer's is
        `recurrent`."""
        built: dict[tuple[int, Optional[int]], Any] = {}
        metas = []
        attending = iter(layer_batches) if layer_batches is not None else None
        for layer in self.plan.layers:
            if layer.recurrent:
                metas.append(recurrent)
                continue
            seen = batch if attending is None else next(attending)
            window = capped_window(layer.attention.window, seen.window)
            key = (id(seen), window)
            if key not in built:
                built[key] = self.attention.build(
                    seen if window == seen.window else replace(seen, window=window))
            metas.append(built[key])
        return metas

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: list[Any]) -> torch.Tensor:
        """`meta` comes from `self.attention_metadata` for this batch."""
        if positions.numel():
            self._check_position(int(positions.max()))
        return self.hidden_states(input_ids, positions, kv_caches, meta)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: list[Any]) -> torch.Tensor:
        """`forward` without its check of the positions, which reads them back from the
        device: for a CUDA graph's capture (rtpkv.engine.cuda_graphs), whose caller checks the
        host's ids and positions (`check_ids`) before copying them in."""
        residual = self.model.embed_tokens(input_ids)   # the residual stream, added to in place
        if self.embedding_scale is not None:
            residual = residual * self.embedding_scale
        if self.fused is not None:
            return self.fused.forward(residual, positions, kv_caches, meta)
        h = None
        for layer, plan, kv, layer_meta in zip(self.model.layers, self.plan.layers, kv_caches,
                                               meta):
            rope = plan.attention.rope
            h = layer(residual, h, positions, None if rope is None else self.ropes[rope], kv,
                      layer_meta, self.attention)
        return self.model.norm(h, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.plan.logit_scale is not None:   # in the model's dtype, as transformers
            logits = logits * self.plan.logit_scale
        cap = self.plan.final_softcap
        if cap is not None:   # in the model's dtype, as transformers
            logits = soft_cap(logits, cap)
        if self.plan.logits_divisor is not None:
            logits = logits / self.plan.logits_divisor
        return logits.float()

    def forward_logits(self, ids: list[int], positions: list[int],
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: list[Any],
                       rows: list[int]) -> torch.Tensor:
        """The float32 logits of `rows` of the forward over token `ids` at `positions`: what
        the engine samples from. Where the fused decoder runs, one C call from the ids to the
        logits, with no torch op between (kernels/fused_decoder.py)."""
        if self.fused is not None:   # it reads ids, positions and rows unchecked
            self.check_ids(ids, positions)
            if rows and not (len(rows) <= len(ids) and 0 <= min(rows) <= max(rows) < len(ids)):
                raise IndexError(f"logit rows {min(rows)}..{max(rows)} ({len(rows)} of them) "
                                 f"are not rows of a forward of {len(ids)} tokens")
            return self.fused.logits(ids, positions, kv_caches, meta, rows)
        device = self.cos.device
        hidden = self.forward(torch.tensor(ids, device=device),
                              torch.tensor(positions, device=device), kv_caches, meta)
        return self.logits(hidden[torch.tensor(rows, dtype=torch.long, device=device)])

    def generate(self, ids: list[int], positions: list[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: list[Any], steps: int,
                 stops: list[list[int]]) -> list[list[int]]:
        """Up to `steps` greedy decode steps of one token per sequence in one C call
        (FusedDecoder.generate, `meta` built for the first step with tables covering the last,
        each layer's):
        each step's arg-max tokens; fewer steps once every row has met one of its `stops`.
        Only where the fused decoder runs."""
        if self.fused is None:
            raise RuntimeError("decode steps in one call need the fused CPU decoder")
        distinct = {id(m): m for m in meta}.values()   # one per window and KV cache group
        for layer_meta in distinct:
            lengths = layer_meta.table_lengths
            if not (len(ids) == len(stops) == len(lengths) == layer_meta.T and steps >= 1):
                raise ValueError(f"{len(ids)} ids, {len(stops)} stop lists, {len(lengths)} "
                                 f"block tables, {layer_meta.T} rows and {steps} steps")
        self.check_ids(ids, [p + steps - 1 for p in positions])   # the last step's positions
        for layer_meta in distinct:   # the C loop writes K/V at each position, in every group
            B = layer_meta.block_size
            for row, (position, length) in enumerate(zip(positions, layer_meta.table_lengths)):
                if (position + steps - 1) // B >= length:
                    raise IndexError(f"row {row}: {steps} steps from position {position} pass "
                                     f"the end of its block table ({length} blocks of {B})")
        return self.fused.generate(ids, positions, kv_caches, meta, steps, stops)

    def check_ids(self, ids: list[int], positions: list[int]) -> None:
        """What the fused decoder and a CUDA graph's replay read unchecked: one position per id,
        each inside the RoPE table, each id inside the vocabulary."""
        if len(positions) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(positions)} positions")
        if ids:
            self._check_position(max(positions))
            if not 0 <= min(ids) <= max(ids) < self.spec.vocab_size:
                raise IndexError(f"token ids {min(ids)}..{max(ids)} are outside the "
                                 f"vocabulary [0, {self.spec.vocab_size})")

    def _check_position(self, position: int) -> None:
        if position >= self.cos.shape[0]:
            raise IndexError(f"position {position} is past the RoPE table "
                             f"({self.cos.shape[0]} positions)")
