"""A forward's decoder layers in one C call (csrc/decoder.c) where the model runs on the C
kernels end to end: float32 on the CPU, linear layers all on the avx2, the bf16-weight, the
int8 or the w8a8 kernel, the CPU paged-attention backend (over a float32 or an int8 KV cache),
the fused ops, each sparse layer's mixture of experts in its own C call (kernels/moe_experts.py,
which decoder.c calls by address), and a layer plan (model_factory/plan.py) it computes
(`runs_plan`: Llama's, Qwen3's and Gemma 3's layers, each over its own window, RoPE table and KV
cache group). It calls the same kernels the per-layer Python
path calls, in the same order, so the two give the same bits (tests/kernels/test_fused_decoder.py);
it only removes the Python between them, which dominates the small kernels of a one-token decode
step. `FusedDecoder.build`
returns None for any other model, and CausalLM then runs its layers one by one.

`logits` is the engine's call: from token ids to the LM head's logits of the rows that sample
in that one call, on Python ints and a per-thread scratch buffer, so a decode step makes one
torch op (the logits' tensor) where it made a dozen. A torch op there costs several times what
it costs in a loop, 15-50 us: the weights streamed through the caches every step have evicted
the code and data of torch's dispatcher (docs/BENCHMARKS.md, "A decode step without torch
ops"). `generate` is the engine's call for a burst (NUM_SCHEDULER_STEPS): several greedy decode
steps of that same forward in one C call, each step's arg-max tokens fed to the next."""

from __future__ import annotations

import ctypes
import mmap
import threading
from array import array
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch

from rtpkv.kernels.cpu_attention import CpuMetadata, CpuPagedAttention, kernel_args, _Args
from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.fused_ops import ptr
from rtpkv.kernels.huge_pages import HUGE_PAGE, huge_page_buffer
from rtpkv.kernels import fused_ops, weight_types
from rtpkv.kernels.int8_linear import Int8Linear, QuantizedLinear


class DecoderModel(Protocol):
    """What the fused decoder reads of a model (model_factory's CausalLM is one): its spec and
    layer plan, the backbone's embedding, layers and final norm (`model`), the LM head, the
    plan's RoPE tables by name, the embedding scale and the attention backend. The kernels name
    this shape, not the model's class."""

    spec: Any
    plan: Any   # a model_factory/plan.py ModelPlan (data the kernels read; not imported here)
    model: torch.nn.Module
    lm_head: torch.nn.Module
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]
    embedding_scale: Optional[torch.Tensor]
    attention: Any

_P = ctypes.c_void_p
_I = ctypes.c_int64


class LinearArgs(ctypes.Structure):
    _fields_ = [("weight", _P), ("scale", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("pre_ff_norm", _P), ("post_ff_norm", _P),
                ("q_norm", _P), ("k_norm", _P), ("cos", _P), ("sin", _P),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("gelu", _I),
                ("qkv", LinearArgs),
                ("o", LinearArgs), ("gate_up", LinearArgs), ("down", LinearArgs), ("moe", _P),
                ("k_cache", _P), ("v_cache", _P), ("sinks", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I),
                ("head_dim", _I), ("inter", _I), ("eps", ctypes.c_float),
                ("linear_kind", _I), ("int8_group", _I), ("panel_rows", _I),
                ("embedding_scale", ctypes.c_float), ("final_softcap", ctypes.c_float),
                ("final_norm", _P), ("embedding", _P),
                ("lm_head", LinearArgs), ("vocab", _I)]


class _View(ctypes.Structure):
    _fields_ = [("q_seq", _P), ("q_pos", _P), ("tables", _P), ("max_blocks", _I),
                ("write_rows", _P), ("window", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _I), ("ids", _P), ("residual", _P), ("out", _P), ("num_logits", _I),
                ("logit_rows", _P), ("logits", _P), ("positions", _P),
                ("attn", _Args), ("views", ctypes.POINTER(_View)), ("num_views", _I),
                ("layer_view", _P), ("tile_start", _P), ("num_tiles", _I),
                ("layer", ctypes.POINTER(_Layer)), ("x", _P), ("qkv", _P), ("q", _P),
                ("att", _P), ("h", _P), ("gate_up", _P), ("act", _P), ("seconds", _P)]


class _Burst(ctypes.Structure):
    _fields_ = [("steps", _I), ("tokens", _P), ("ids", _P), ("positions", _P),
                ("stop_start", _P), ("stop_ids", _P)]


# A thread's scratch is kept from one forward to the next, for the thread's life, grown to the
# largest forward's (at most a step's token budget of rows: ~33 KB a row on the benchmark
# model), and from this size on is in 2 MiB pages (kernels/huge_pages.py). A 2,064-row
# prefill's, 69 MB, allocated per forward in 4 KiB pages, took ~17,000 page faults a step and an
# unmap (about 15 ms on the benchmark EPYC, 4% of the step); given back at each heap trim and
# allocated again, the next cold 2,064-token prefill took 9-25 ms longer than on a kept one.
HUGE_SCRATCH_BYTES = 2 * HUGE_PAGE

# the linear layers' path -> (LINEAR_* of csrc/kernels.h, the fewest rows of its prefill tiles)
LINEAR_KINDS = {"avx2": (0, 0), **{t.layer.path: (t.kernel_kind, t.panel_rows)
                                   for t in weight_types.REGISTRY.values()}}


def kernel_weights(layers: Iterable[Any]) -> list[tuple[Any, str]]:
    """(layer, name) of each tensor the C kernels read a weight from, for `layers` on a C kernel
    path (LINEAR_KINDS): float32 or bf16 panels (`packed`, `q`), int8 blocks and
    their scales (`q`, `scale`). Other layers (oneDNN's own packed format, torch's) give none."""
    return [(layer, name) for layer in layers if getattr(layer, "path", None) in LINEAR_KINDS
            for name in ("packed", "q", "scale")
            if isinstance(getattr(layer, name, None), torch.Tensor)]


_SIGNATURES: Signatures = {
    "rtpkv_decoder_forward": ([ctypes.POINTER(_Model), ctypes.POINTER(_Step)], None),
    "rtpkv_decoder_generate": ([ctypes.POINTER(_Model), ctypes.POINTER(_Step),
                                ctypes.POINTER(_Burst)], _I)}


def _library() -> Optional[ctypes.CDLL]:
    return bound_library("decoder", _SIGNATURES, "fused_ops", "fp32_linear", "int8_linear",
                         "w8a8_linear", "paged_attention", "moe_experts")


# the layer plan's MLP kinds decoder.c computes, as its `gelu` flag
MLP_KINDS = {"silu": 0, "gelu_tanh": 1}


def runs_plan(plan: Any) -> bool:
    """Whether decoder.c computes `plan`. Per layer it takes Llama's two norms or Gemma's four,
    plain or (1 + w) (the same RMSNorm over a weight holding 1 + w), SwiGLU or GeGLU, any softmax
    scale, q/k norms or none, any of the plan's RoPE tables and any window (each layer's
    attention metadata gives its window and its KV cache group's tables); and an embedding
    scale, Gemma 2's soft-caps of attention scores (the paged kernel's, as the per-layer
    path's cpu-paged backend computes them) and of the logits (activation.soft_cap's C kernel),
    and gpt-oss's attention sinks (the paged kernel's too). It needs one epsilon for every norm:
    a plan with norms of two is refused whole, as is one with what the C code has no op for
    (recurrent layers, attention output gates, Cohere's LayerNorm, parallel block and logit
    scale, layers without RoPE, Granite's residual scale and logits divisor)."""
    eps = plan.final_norm.eps
    return (all(layer.mlp in MLP_KINDS and layer.norm.eps == eps
                and layer.mixer == "attention" and not layer.attention.output_gate
                and not layer.parallel and not layer.norm.centered
                and layer.attention.rope is not None
                and layer.residual_scale is None
                for layer in plan.layers)
            and not plan.final_norm.centered and plan.logit_scale is None
            and plan.logits_divisor is None)


def _sparse(mlp: torch.nn.Module) -> bool:
    """Whether a layer's MLP is a mixture of experts (model_factory/moe.py's SparseMoe, whose
    `kernel` is the layer's C call, or None where it has none)."""
    return hasattr(mlp, "experts")


def _norm_weight(norm: torch.nn.Module) -> int:
    """The address of the float32 weight the RMSNorm multiplies by: a (1 + w) norm's 1 + w
    (model_factory/llama.py's RMSNorm.scale), else its weight."""
    return (norm.weight if norm.scale is None else norm.scale).data_ptr()


def linear_args(layer: torch.nn.Module) -> LinearArgs:
    if isinstance(layer, QuantizedLinear):
        return LinearArgs(layer.q.data_ptr(), ptr(layer.scale), ptr(layer.bias))
    return LinearArgs(layer.packed.data_ptr(), None, ptr(layer.bias))


class FusedDecoder:
    """The decoder layers of `module` as one C call; holds the weights' addresses, so it lives
    as long as the module and its KV pool."""

    def __init__(self, module: "DecoderModel", lib: ctypes.CDLL):
        spec, backbone = module.spec, module.model
        self.lib = lib
        self.module = module
        self.hidden, self.heads, self.kv_heads = spec.hidden_size, spec.num_heads, spec.num_kv_heads
        self.head_dim, inter = spec.head_dim, spec.intermediate_size
        self.vocab = spec.vocab_size
        q_size = self.heads * self.head_dim
        # a forward's scratch, T rows each of x, qkv, q, attention out, h, gate_up, act, in one
        # buffer: where each starts, in floats per row of T, and the floats per row of all
        widths = (self.hidden, q_size + 2 * self.kv_heads * self.head_dim, q_size, q_size,
                  self.hidden, 2 * inter, inter)
        self.scratch_starts = [sum(widths[:i]) for i in range(len(widths))]
        self.scratch_width = sum(widths)
        first = backbone.layers[0].self_attn.qkv
        kind, panel_rows = LINEAR_KINDS[first.path]
        self.model = _Model(
            len(backbone.layers), self.hidden, self.heads, self.kv_heads, self.head_dim,
            inter, spec.rms_norm_eps, kind,
            first.group_size if isinstance(first, Int8Linear) else 0,   # LINEAR_INT8's only
            panel_rows, 0.0 if module.embedding_scale is None else module.embedding_scale.item(),
            module.plan.final_softcap or 0.0,
            _norm_weight(backbone.norm), backbone.embed_tokens.weight.data_ptr(),
            linear_args(module.lm_head), self.vocab)
        # the last layer table made, with the addresses of the K/V caches it points into
        self._table: Optional[tuple[tuple[int, ...], ctypes.Array]] = None
        # each thread's float32 buffer for `logits` (residual, final hidden and scratch rows),
        # kept from one forward to the next (HUGE_SCRATCH_BYTES)
        self._buffers = threading.local()
        # float64 (3,): when set, each forward adds the wall seconds of its linear layers,
        # attention with the KV write, and elementwise kernels (SECONDS_* in csrc/decoder.c;
        # benchmarks/decode_step.py); None in service
        self.seconds: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, module: "DecoderModel") -> Optional["FusedDecoder"]:
        """The fused decoder of `module`, or None where it does not run end to end on the C
        kernels (then its layers run one by one)."""
        spec, backbone = module.spec, module.model
        if spec.linear_attention is not None or spec.mamba is not None:
            return None   # csrc/decoder.c has no recurrent layer
        weight = backbone.embed_tokens.weight
        linears = [m for layer in backbone.layers
                   for m in (layer.self_attn.qkv, layer.self_attn.o_proj,
                             *(() if _sparse(layer.mlp) else (layer.mlp.gate_up,
                                                              layer.mlp.down_proj)))]
        linears.append(module.lm_head)
        eligible = (
            weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.is_contiguous()
            and isinstance(module.attention, CpuPagedAttention)
            and all(layer.mlp.kernel is not None for layer in backbone.layers
                    if _sparse(layer.mlp))
            and runs_plan(module.plan)
            and len({m.path for m in linears}) == 1 and linears[0].path in LINEAR_KINDS
            and spec.head_dim % fused_ops.ROPE_MULTIPLE == 0
            and spec.hidden_size % fused_ops.ROW_MULTIPLE == 0
            and spec.intermediate_size % fused_ops.ROW_MULTIPLE == 0)
        if not eligible:
            return None
        lib = _library()
        return None if lib is None else cls(module, lib)

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array:
        """The per-layer table over `kv_caches`, remade when any cache's address changes: a new
        pool can start where a freed one did with its layers at other offsets. Read and replaced
        as one attribute, and passed per call, so engines sharing the module on their own
        threads each run on their own pool."""
        key = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        cached = self._table
        if cached is None or cached[0] != key:
            layers = self.module.model.layers
            table = (_Layer * len(layers))()
            plans = self.module.plan.layers
            for entry, layer, plan, (k_cache, v_cache) in zip(table, layers, plans, kv_caches):
                attn, mlp = layer.self_attn, layer.mlp
                entry.input_norm = _norm_weight(layer.input_layernorm)
                entry.post_norm = _norm_weight(layer.post_attention_layernorm)
                if plan.sandwich:
                    entry.pre_ff_norm = _norm_weight(layer.pre_feedforward_layernorm)
                    entry.post_ff_norm = _norm_weight(layer.post_feedforward_layernorm)
                if plan.attention.qk_norm:
                    entry.q_norm = _norm_weight(attn.q_norm)
                    entry.k_norm = _norm_weight(attn.k_norm)
                cos, sin = self.module.ropes[plan.attention.rope]
                entry.cos, entry.sin = cos.data_ptr(), sin.data_ptr()
                entry.scale = plan.attention.scale
                entry.softcap = plan.attention.softcap or 0.0
                entry.gelu = MLP_KINDS[plan.mlp]
                entry.qkv, entry.o = linear_args(attn.qkv), linear_args(attn.o_proj)
                if _sparse(mlp):
                    entry.moe = mlp.kernel.address
                else:
                    entry.gate_up = linear_args(mlp.gate_up)
                    entry.down = linear_args(mlp.down_proj)
                entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                if plan.attention.sinks:
                    entry.sinks = attn.sinks.data_ptr()
            cached = self._table = (key, table)
        return cached[1]

    def _views(self, metas: Sequence[CpuMetadata]) -> tuple[ctypes.Array, ctypes.Array]:
        """The distinct views among the layers' `metas` (a model of one window and one KV cache
        group has one) and each layer's index into them."""
        index: dict[int, int] = {}
        distinct: list[CpuMetadata] = []
        order = []
        for meta in metas:
            i = index.get(id(meta))
            if i is None:
                i = index[id(meta)] = len(distinct)
                distinct.append(meta)
            order.append(i)
        views = (_View * len(distinct))(*(
            _View(m.row_seq_at, m.positions_at, m.tables_at, m.width, m.write_rows_at, m.window)
            for m in distinct))
        return views, (_I * len(order))(*order)

    def _step(self, T: int, positions: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              metas: Sequence[CpuMetadata], residual: int, out: int, scratch: int,
              ids: Optional[int] = None, logit_rows: Optional[int] = None, num_logits: int = 0,
              logits: Optional[int] = None) -> _Step:
        """One C forward's arguments over addresses: `positions`, `ids` and `logit_rows` of
        int64 values, `scratch` of T * scratch_width floats; `metas` each layer's (the batch's
        rows and tiles are the same in all of them)."""
        first = metas[0]
        attn = kernel_args(first, T, self.heads, self.kv_heads, self.head_dim, 0.0,
                           bf16=False, kv_int8=kv_caches[0][0].dtype == torch.int8)
        views, layer_view = self._views(metas)
        step = _Step(T, ids, residual, out, num_logits, logit_rows, logits, positions, attn,
                     views, len(views), ctypes.addressof(layer_view), first.tile_start_at,
                     first.num_tiles, self._layer_table(kv_caches),
                     *(scratch + 4 * T * start for start in self.scratch_starts),
                     ptr(self.seconds))
        step.layer_view_array = layer_view   # held as long as the step
        return step

    def _buffer(self, floats: int) -> torch.Tensor:
        """A float32 buffer of at least `floats` floats: this thread's, kept, replaced by a
        larger one when too small (in 2 MiB pages from HUGE_SCRATCH_BYTES on, rounded up to
        whole ones)."""
        buffer = getattr(self._buffers, "floats", None)
        if buffer is None or buffer.numel() < floats:
            self._buffers.floats = None   # the old one freed before the new one is mapped
            nbytes = 4 * floats
            if nbytes >= HUGE_SCRATCH_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
                nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
                buffer = huge_page_buffer(nbytes).view(torch.float32)
            else:
                buffer = torch.empty(floats, dtype=torch.float32)
            self._buffers.floats = buffer
        return buffer

    def reserve(self, rows: int) -> None:
        """This thread's scratch for forwards of up to `rows` rows, its pages touched now: the
        engine reserves a step's token budget when it starts (as vLLM's profile run sizes its
        activations), so no request pays the first mapping of a long prefill's scratch."""
        with torch.inference_mode():
            self._buffer(rows * (self.scratch_width + 2 * self.hidden)).zero_()

    def forward(self, residual: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metas: Sequence[CpuMetadata]) -> torch.Tensor:
        """residual: (T, hidden) embeddings, scaled (updated in place); returns the final hidden
        states. `metas`: each layer's attention metadata."""
        T = residual.shape[0]
        buffer = residual.new_empty(T * self.scratch_width)
        out = residual.new_empty(T, self.hidden)
        # the C code reads int64 (the per-layer path takes any integer dtype); no copy when so
        positions = positions.to(torch.int64).contiguous()
        step = self._step(T, positions.data_ptr(), kv_caches, metas, residual.data_ptr(),
                          out.data_ptr(), buffer.data_ptr())
        self.lib.rtpkv_decoder_forward(ctypes.byref(self.model), ctypes.byref(step))
        return out

    def _from_ids(self, ids: Sequence[int], positions: Sequence[int],
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  metas: Sequence[CpuMetadata], rows: Sequence[int], logits: torch.Tensor
                  ) -> tuple[_Step, array, torch.Tensor]:
        """The arguments of a forward from token `ids` at `positions` to the LM head's logits
        of `rows`, on this thread's scratch; with the int64 array of ids, positions and rows
        and the scratch, which must outlive the call."""
        T, E = len(ids), self.hidden
        buffer = self._buffer(T * (self.scratch_width + 2 * E))
        base = buffer.data_ptr()
        ints = array("q", ids)
        ints.extend(positions)
        ints.extend(rows)
        address, size = ints.buffer_info()[0], ints.itemsize
        step = self._step(T, address + size * T, kv_caches, metas, base, base + 4 * T * E,
                          base + 8 * T * E, ids=address, logit_rows=address + size * 2 * T,
                          num_logits=len(rows), logits=logits.data_ptr())
        return step, ints, buffer

    def logits(self, ids: Sequence[int], positions: Sequence[int],
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               metas: Sequence[CpuMetadata], rows: Sequence[int]) -> torch.Tensor:
        """The LM head's float32 logits (len(rows), vocab) of `rows` of this forward over token
        `ids` at `positions`. Unchecked here (CausalLM.forward_logits checks): ids below the
        vocabulary's size, one position per id, at most len(ids) rows, each below it."""
        logits = torch.empty(len(rows), self.vocab, dtype=torch.float32)
        step, _ints, _buffer = self._from_ids(ids, positions, kv_caches, metas, rows, logits)
        self.lib.rtpkv_decoder_forward(ctypes.byref(self.model), ctypes.byref(step))
        return logits

    def generate(self, ids: Sequence[int], positions: Sequence[int],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 metas: Sequence[CpuMetadata], steps: int,
                 stops: Sequence[Sequence[int]]) -> list[list[int]]:
        """Up to `steps` greedy decode steps of len(ids) sequences, one row each (`metas` built
        for the first step, their block tables covering every position the steps reach; their
        positions and write rows are advanced in place): each step's arg-max tokens, a list per
        step, in row order; each step's logits overwrite the last's. Stops early once every row
        has produced one of its `stops`. Unchecked here (CausalLM.generate checks)."""
        T = len(ids)
        logits = torch.empty(T, self.vocab, dtype=torch.float32)   # not kept: vocab-sized
        step, ints, _buffer = self._from_ids(ids, positions, kv_caches, metas, range(T), logits)
        stop = array("q", [0])
        for row in stops:
            stop.append(stop[-1] + len(row))
        for row in stops:
            stop.extend(row)
        tokens = array("q", bytes(8 * steps * T))
        address, stop_at = ints.buffer_info()[0], stop.buffer_info()[0]
        burst = _Burst(steps, tokens.buffer_info()[0], address, address + 8 * T, stop_at,
                       stop_at + 8 * (T + 1))
        done = self.lib.rtpkv_decoder_generate(ctypes.byref(self.model), ctypes.byref(step),
                                               ctypes.byref(burst))
        return [tokens[i * T:(i + 1) * T].tolist() for i in range(done)]
