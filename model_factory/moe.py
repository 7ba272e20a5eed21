"""Mixture-of-experts MLP layers (Qwen3-MoE, Qwen2-MoE and Qwen3-Next with their shared expert,
Mixtral, gpt-oss, Granite 4.0-H's): the facts read from config.json (`MoeSpec`), the names of
published checkpoints mapped onto the module's (`checkpoint_name`, `checkpoint_tensors`), and the
layer itself (`SparseMoe`).

gpt-oss's experts are their own kind: biased projections and the clamped SwiGLU
((clamp(up) + 1) * g * sigmoid(alpha * g), g the gate clamped above), its router biased and its
weights a softmax over the top-k logits only. Its checkpoint stacks each layer's experts
(`experts.gate_up_proj`: (experts, hidden, 2 * inter), gate and up columns interleaved, or the
published MXFP4 form, `*_blocks` and `*_scales`); they are split into one module per expert at
load, gate and up apart, MXFP4 dequantized to the model's dtype one expert at a time.

Routing is computed as transformers computes it, because another expert choice is another
answer: the router's logits, a float32 softmax, torch.topk (its tie-breaking), the optional
renormalisation of the top-k weights, and the weights cast to the activations' dtype before they
scale an expert's output (Qwen) or the output scaled in float32 and cast after (Mixtral); Granite
4.0-H's weights are a softmax over its top-k float32 logits, its shared expert ungated.

Tokens are grouped by expert: each expert chosen by any token of the forward runs one GEMM pair
over all of its tokens, so its weights are read once per forward however many tokens chose it.
A token's output is its experts' scaled outputs added one by one, in ascending expert order,
onto zeros (transformers' order too): the order depends on the token's own choice only, and
every kernel on the way computes a row from that row alone (the linear layers are
batch-invariant, kernels/linear.py; the shared expert's gate is `_sigmoid`), so a token's
output does not depend on which other tokens share the forward (reuse on == off, alone ==
batched, bit for bit). Where every expert runs on the C linear kernels (avx2, bf16 weights,
int8, w8a8) and the router on the float32 one, the whole layer (router, routing, experts,
shared expert) runs in one C call (kernels/moe_experts.py), which the fused decoder calls too:
the same experts and the same order, its softmax's last bit libm's rather than torch's, and
experts whose probabilities tie exactly taken lowest index first (torch.topk's pick among exact
ties is its sort's, unspecified; distinct router rows tie with probability zero).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rtpkv.errors import ConfigError
from rtpkv.kernels.fused_decoder import kernel_weights
from rtpkv.kernels.huge_pages import into_huge_pages
from rtpkv.kernels.moe_experts import ExpertKernel

GPT_OSS = "GptOssForCausalLM"
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", GPT_OSS,
                     "Qwen3NextForCausalLM")
# their always-on expert, scaled by sigmoid(shared_expert_gate)
_SHARED_EXPERT_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"   # a mixture where num_local_experts > 0

# the experts' activation, both the C expert call's: "silu" (SwiGLU), "clamped_swiglu" (gpt-oss)
SILU_EXPERTS = "silu"
CLAMPED_SWIGLU_EXPERTS = "clamped_swiglu"

# gpt-oss's stacked expert tensors: (layer prefix, what) -> one tensor per expert
_GPT_OSS_EXPERTS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_GPT_OSS_ROUTER = re.compile(r"^(.*\.mlp)\.router\.(weight|bias)$")
_GPT_OSS_MXFP4 = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
# the 16 values of an FP4 (e2m1) nibble
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Mixtral's published names -> the module's (Qwen's, which the module uses as they are)
_MIXTRAL_NAMES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),
                  (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
                  (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
                  (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."))


@dataclass(frozen=True)
class MoeSpec:
    """What a mixture-of-experts checkpoint adds to a dense one."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool                # renormalise the chosen experts' weights to sum to 1
    scale_in_float32: bool               # Mixtral: outputs scaled by float32 weights, then cast
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert; 0: none
    sparse_layers: tuple[int, ...]       # the layers whose MLP is the mixture
    activation: str = SILU_EXPERTS       # the experts' (SILU_EXPERTS or CLAMPED_SWIGLU_EXPERTS)
    swiglu_alpha: float = 1.0            # the clamped SwiGLU's sigmoid gain
    swiglu_limit: float = 0.0            # and its clamp
    expert_bias: bool = False            # the experts' projections have biases
    router_bias: bool = False
    # the weights are a softmax over the top-k logits only, not the top-k of a softmax over
    # every expert (gpt-oss, Granite 4.0-H)
    softmax_after_top_k: bool = False
    gated_shared_expert: bool = True     # False: the shared expert is added ungated (Granite)

    @classmethod
    def from_config(cls, architecture: str, cfg: dict[str, Any],
                    source: str = "config.json") -> Optional["MoeSpec"]:
        """The MoE facts of `cfg`, or None for a dense architecture (or a Qwen3-Next with
        num_experts 0, which transformers builds dense)."""
        if architecture == GRANITE_HYBRID:   # dense where num_local_experts is 0
            return cls._granite(cfg, source)
        if architecture not in MOE_ARCHITECTURES:
            return None
        if architecture == "Qwen3NextForCausalLM" and not cfg.get("num_experts"):
            return None
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        per_token = int(cfg.get("num_experts_per_tok") or 0)
        if experts < 1:
            raise ConfigError(f"{source}: num_experts={experts} is invalid: a mixture of experts "
                              "needs at least 1 expert")
        if not 1 <= per_token <= experts:
            raise ConfigError(f"{source}: num_experts_per_tok={per_token} is invalid: accepted "
                              f"range is 1..{experts} (num_experts)")
        if architecture == GPT_OSS:
            return cls(experts, per_token, int(cfg["intermediate_size"]), False, False, 0,
                       tuple(range(layers)), CLAMPED_SWIGLU_EXPERTS,
                       float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)),
                       expert_bias=True, router_bias=True, softmax_after_top_k=True)
        if architecture == "MixtralForCausalLM":
            return cls(experts, per_token, int(cfg["intermediate_size"]), True, True, 0,
                       tuple(range(layers)))
        step = int(cfg.get("decoder_sparse_step") or 1)
        if step < 1:
            raise ConfigError(f"{source}: decoder_sparse_step={step} is invalid: accepted "
                              "values are 1 and above")
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = (int(cfg.get("shared_expert_intermediate_size") or 0)
                  if architecture in _SHARED_EXPERT_ARCHITECTURES else 0)
        return cls(experts, per_token, int(cfg["moe_intermediate_size"]),
                   bool(cfg.get("norm_topk_prob", False)), False, shared, sparse)


    @classmethod
    def _granite(cls, cfg: dict[str, Any], source: str) -> Optional["MoeSpec"]:
        experts = int(cfg.get("num_local_experts", 8))   # transformers' defaults
        if not experts:
            return None
        per_token = int(cfg.get("num_experts_per_tok", 2))
        if not 1 <= per_token <= experts:
            raise ConfigError(f"{source}: num_experts_per_tok={per_token} is invalid: accepted "
                              f"range is 1..{experts} (num_local_experts)")
        return cls(experts, per_token, int(cfg["intermediate_size"]), False, False,
                   int(cfg["shared_intermediate_size"]),
                   tuple(range(int(cfg["num_hidden_layers"]))), softmax_after_top_k=True,
                   gated_shared_expert=False)


def checkpoint_name(architecture: str, name: str) -> str:
    """The module's name for checkpoint tensor `name` (Mixtral's block_sparse_moe and w1/w2/w3
    become mlp and gate/down/up; every other name is the module's already)."""
    if architecture == "MixtralForCausalLM":
        for pattern, replacement in _MIXTRAL_NAMES:
            name = pattern.sub(replacement, name)
    return name


def checkpoint_tensors(architecture: str, tensors: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under the module's names (`checkpoint_name`); gpt-oss's stacked
    experts split into one projection per expert (gate and up de-interleaved, each weight a
    linear layer's (out, in)), its MXFP4 ones (`*_blocks` and `*_scales`) dequantized one expert
    at a time, its `router` named `gate`."""
    packed: dict[tuple[str, str, str], torch.Tensor] = {}   # an MXFP4 pair's first half
    for name, tensor in tensors:
        if architecture != GPT_OSS:
            yield checkpoint_name(architecture, name), tensor
            continue
        router = _GPT_OSS_ROUTER.match(name)
        experts = _GPT_OSS_EXPERTS.match(name)
        mxfp4 = _GPT_OSS_MXFP4.match(name)
        if router:
            yield f"{router[1]}.gate.{router[2]}", tensor
        elif experts and experts[3]:   # biases: (experts, out)
            yield from _expert_tensors(experts[1], experts[2], "bias", tensor)
        elif experts:   # (experts, in, out)
            yield from _expert_tensors(experts[1], experts[2], "weight",
                                       (stacked.t() for stacked in tensor))
        elif mxfp4:
            prefix, what, part = mxfp4[1], mxfp4[2], mxfp4[3]
            other = packed.pop((prefix, what, "scales" if part == "blocks" else "blocks"), None)
            if other is None:
                packed[(prefix, what, part)] = tensor
                continue
            blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
            yield from _expert_tensors(prefix, what, "weight",
                                       (mxfp4_weight(b, s) for b, s in zip(blocks, scales)))
        else:
            yield name, tensor
    if packed:
        raise ValueError(f"MXFP4 expert weights without their other half: "
                         f"{sorted(f'{p}.experts.{w}_{h}' for p, w, h in packed)[:3]}")


def _expert_tensors(prefix: str, what: str, kind: str, per_expert: Iterable[torch.Tensor]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's experts' `kind` tensors, one (out, ...) tensor per expert, under the module's
    names: down_proj's as they are, gate_up_proj's rows de-interleaved into gate and up."""
    for index, tensor in enumerate(per_expert):
        base = f"{prefix}.experts.{index}"
        if what == "down_proj":
            yield f"{base}.down_proj.{kind}", tensor.contiguous()
        else:
            yield f"{base}.gate_proj.{kind}", tensor[::2].contiguous()
            yield f"{base}.up_proj.{kind}", tensor[1::2].contiguous()


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's MXFP4 matrix as float32 (out, in): `blocks` (out, in / 32, 16) bytes, each
    two FP4 (e2m1) values, the low nibble first; `scales` (out, in / 32) exponents biased by
    127, one per 32 values. The values transformers' convert_moe_packed_tensors gives (FP4 times
    a power of two is exact in float32 and bfloat16 alike)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "do not pair: blocks must be scales' shape plus 16 bytes")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)   # (out, in / 32, 32)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


class SparseMoe(nn.Module):
    """The mixture-of-experts MLP of one layer: a router (`gate`), `experts` (gated MLPs made by
    `make_mlp(intermediate_size)`, as published: one module per expert) and, for Qwen2-MoE and Qwen3-Next, a
    `shared_expert` every token runs, scaled by sigmoid(`shared_expert_gate`)."""

    def __init__(self, hidden_size: int, moe: MoeSpec, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.top_k = moe.experts_per_token
        self.normalize_top_k = moe.normalize_top_k
        self.scale_in_float32 = moe.scale_in_float32
        self.softmax_after_top_k = moe.softmax_after_top_k
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(make_mlp(moe.expert_intermediate_size)
                                     for _ in range(moe.num_experts))
        self.shared_expert: Optional[nn.Module] = None
        self.kernel: Optional[ExpertKernel] = None   # the layer as one C call, where it can be
        self.shared_expert_gate: Optional[nn.Module] = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = make_mlp(moe.shared_expert_intermediate_size)
            if moe.gated_shared_expert:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def convert(self, convert: Callable[[nn.Linear], nn.Module],
                convert_router: Callable[[nn.Linear], nn.Module]) -> None:
        """After loading: every expert's (and the shared expert's and its gate's) linear layers
        through `convert` (the model's GEMM path or int8 quantization), the router through
        `convert_router` (the float path: the choice of experts stays that of the float
        weights); the layer's weights into huge pages (kernels/huge_pages.py: a step reads a
        different few experts each time); then the layer's C call where it runs on the C
        kernels, which takes their addresses."""
        for expert in self.experts:
            expert.convert(convert)
        if self.shared_expert is not None:
            self.shared_expert.convert(convert)
        if self.shared_expert_gate is not None:
            self.shared_expert_gate = convert(self.shared_expert_gate)
        self.gate = convert_router(self.gate)
        into_huge_pages(kernel_weights(self.modules()))
        self.kernel = ExpertKernel.build(self)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each (tokens, top_k): transformers' routing, row by row."""
        if self.softmax_after_top_k:   # gpt-oss, Granite: the top-k logits' softmax
            logits, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
            return F.softmax(logits.float(), dim=-1).to(x.dtype), experts
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.scale_in_float32 else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == torch.float32:
            return self.kernel(x)
        weights, experts = self.route(x)
        flat = experts.flatten()
        # (token, choice) pairs sorted by expert, tokens ascending within an expert
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts))
        out = self._experts(x, counts.tolist(), order // self.top_k, weights.flatten()[order])
        if self.shared_expert_gate is not None:
            out = out + _sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def _experts(self, x: torch.Tensor, counts: list[int], tokens: torch.Tensor,
                 pair_weights: torch.Tensor) -> torch.Tensor:
        """The experts in torch, in the order the C call adds them (csrc/moe_experts.c)."""
        out = torch.zeros_like(x)
        start = 0
        for index, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start:start + count]
            scaled = self.experts[index](x[rows]) * pair_weights[start:start + count, None]
            out.index_add_(0, rows, scaled.to(x.dtype))
            start += count
        return out


def _sigmoid(column: torch.Tensor) -> torch.Tensor:
    """The logistic function of a (tokens, 1) column, value by value in double precision and
    rounded to the column's dtype: torch.sigmoid gives other bits for the values its vectorized
    loop leaves to its scalar tail, so a token's gate would depend on the token count. One value
    per token: the Python loop costs microseconds."""
    values = [1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))
              for v in column.flatten().tolist()]
    return torch.tensor(values, dtype=column.dtype, device=column.device).view_as(column)
