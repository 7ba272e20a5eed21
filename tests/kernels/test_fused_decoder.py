"""The fused decoder (kernels/fused_decoder.py) gives the bits of the layers run one by one:
hidden states and the KV it writes, on a batch of decodes, a chunk after a cached prefix and a
fresh prompt, for each architecture it takes (qkv bias, tied embeddings, GQA, a window, q/k
norms, mixtures of experts with a dense layer between or a shared expert, Gemma 3's layer plan
with each layer's own window and RoPE table, Gemma 2's soft-caps), in float32, with int8
weights (weight-only and W8A8) and with the int8 KV cache; it is not used where a layer would
leave the C kernels."""

from dataclasses import replace

import pytest
import torch
from attention_batches import attention_batch
from conftest import ARCHITECTURES, load, run

from rtpkv.kernels import fused_decoder
from rtpkv.kernels.fused_decoder import runs_plan
from rtpkv.kernels.kv_quant import quantize_rows
from rtpkv.model_factory.plan import GATED_DELTA, LOCAL_ROPE, MAMBA2, model_plan
from rtpkv.model_factory.tiny import build_tiny_checkpoint

from conftest import needs_c_kernels

pytestmark = needs_c_kernels  # these tests ask for the C kernels by name


BLOCK, NUM_BLOCKS = 4, 24
TABLES = [[3, 9, 14], [1, 4, 7, 8], [5, 2, 11], [6, 10, 12, 13]]
SEQS = [(9, 1), (12, 1), (6, 5), (0, 13)]     # (first position, tokens this step)


ROWS = [0, 1, 6, 19]   # the rows the engine would sample: the last of each sequence


def _forward(module, batch, kv, fused, layer_batches=None):
    """Hidden states of `batch` (each layer's view: `layer_batches`), and the KV pool after it,
    with or without the fused decoder; and the logits of ROWS from `forward_logits`, the
    engine's call, on a copy of the pool."""
    kept, module.fused = module.fused, (module.fused if fused else None)
    try:
        kv, kv_logits = ([(k.clone(), v.clone()) for k, v in kv] for _ in range(2))
        ids = torch.randint(3, module.spec.vocab_size, (len(batch.positions),),
                            generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            hidden = module(ids, batch.positions_tensor, kv,
                            module.attention_metadata(batch, layer_batches))
            logits = module.forward_logits(ids.tolist(), batch.positions, kv_logits,
                                           module.attention_metadata(batch, layer_batches), ROWS)
        return hidden, logits, kv
    finally:
        module.fused = kept


@pytest.mark.parametrize("arch,options,window", [
    ("llama", {}, None), ("qwen2", {}, None), ("mistral", {}, None),
    ("llama_linear_rope", {}, None), ("llama", {"weight_type": "INT8"}, None), ("llama", {}, 6),
    ("llama", {"kv_cache_dtype": "int8"}, None),
    ("qwen2", {"kv_cache_dtype": "int8", "weight_type": "INT8"}, 6),
    ("llama", {"weight_type": "W8A8_INT8"}, None),
    ("qwen2", {"kv_cache_dtype": "int8", "weight_type": "W8A8_INT8"}, 6),
    ("qwen3", {}, None),                                 # q/k norms
    ("qwen3_moe", {}, None),                             # experts, a dense layer between
    ("qwen2_moe", {"weight_type": "INT8"}, None),        # a shared expert
    ("mixtral", {"kv_cache_dtype": "int8", "weight_type": "W8A8_INT8"}, None),
    ("mixtral", {"weight_type": "BF16"}, None),
    ("gemma3", {}, None),     # Gemma's plan: per-layer windows and RoPE tables, (1 + w) norms,
    ("gemma3", {}, 6),        # sandwich norms, GeGLU, q/k norms, the embedding scale
    ("gemma3", {"weight_type": "INT8"}, None),
    ("gemma3", {"kv_cache_dtype": "int8", "weight_type": "W8A8_INT8"}, None),
    ("gemma2", {}, None),     # and soft-caps of attention scores and logits
    ("gemma2", {"kv_cache_dtype": "int8", "weight_type": "INT8"}, 6),
    ("gemma2", {"weight_type": "W8A8_INT8"}, None),
    ("gpt_oss", {}, None),    # attention sinks, q/k/v/o biases, YaRN, gpt-oss's experts
    ("gpt_oss", {"weight_type": "INT8"}, 6),
    ("gpt_oss", {"kv_cache_dtype": "int8", "weight_type": "W8A8_INT8"}, None),
])
def test_the_fused_decoder_gives_the_bits_of_the_layers(checkpoints, monkeypatch, arch, options,
                                                        window):
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    model = load(checkpoints(arch), **options)
    module = model.module
    assert module.fused is not None
    batch = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, module.spec.num_kv_heads,
                            window=window)
    _check_bits(model, batch)


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8"}], ids=["float32", "int8-kv"])
def test_a_long_prefill_gives_the_bits_of_the_layers(checkpoints, monkeypatch, options):
    """A chunk of 80 rows (the decoder writes q, K and V of a long chunk on every thread) and a
    decode beside it."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    model = load(checkpoints("llama"), **options)
    assert model.module.fused is not None
    tables = [[(7 * i + 3) % 20 for i in range(20)], [21, 22]]
    batch = attention_batch(tables, [(0, 80), (5, 1)], BLOCK, NUM_BLOCKS,
                            model.module.spec.num_kv_heads)
    _check_bits(model, batch)


def _check_bits(model, batch, layer_batches=None):
    """The fused decoder's hidden states, K/V writes and logits are the layers' bits."""
    module = model.module
    spec = module.spec
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g),
           torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g))
          for _ in range(spec.num_layers)]
    if model.kv_dtype == torch.int8:
        kv = [(quantize_rows(k), quantize_rows(v)) for k, v in kv]
    fused, fused_logits, fused_kv = _forward(module, batch, kv, True, layer_batches)
    layers, layers_logits, layers_kv = _forward(module, batch, kv, False, layer_batches)
    assert torch.equal(fused, layers)
    for (k1, v1), (k2, v2) in zip(fused_kv, layers_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert fused_logits.shape == (len(ROWS), spec.vocab_size)
    assert torch.equal(fused_logits, layers_logits)
    with torch.inference_mode():
        assert torch.equal(fused_logits, module.logits(layers[ROWS]))


# a sliding KV cache group's block tables: other blocks than TABLES', as many per sequence
GROUP_TABLES = [[20, 15, 2], [0, 17, 22, 23], [18, 21, 16], [19, 13, 3, 12]]


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8", "weight_type": "W8A8_INT8"}])
def test_layers_of_their_own_windows_and_tables_give_the_bits_of_the_layers(
        tmp_path, monkeypatch, options):
    """Gemma 3 with a window of 4, inside the batch's contexts, its sliding layers reading and
    writing other block tables than its full layers (a KV cache group of their own): the fused
    decoder gives the layers' bits."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    model = load(build_tiny_checkpoint(tmp_path, **{**ARCHITECTURES["gemma3"],
                                                    "sliding_window": 4}), **options)
    module = model.module
    assert module.fused is not None
    windows = [layer.attention.window for layer in module.plan.layers]
    assert set(windows) == {None, 4}
    batch = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, module.spec.num_kv_heads)
    sliding = replace(batch, block_tables=GROUP_TABLES)
    _check_bits(model, batch, [batch if w is None else sliding for w in windows])


@pytest.mark.parametrize("arch,env,options", [
    ("llama", {"RTPKV_LINEAR": "onednn"}, {}),          # a oneDNN GEMM in between
    ("llama", {"RTPKV_ATTENTION": "torch"}, {}),        # the torch attention backend
    ("mixtral", {"RTPKV_LINEAR": "onednn"}, {}),        # experts off the C kernels
    ("gemma2", {"RTPKV_ATTENTION": "torch"}, {}),       # soft-capped on the torch backend
    ("llama", {}, {"dtype": "bfloat16"}),
])
def test_the_layers_run_one_by_one_where_one_leaves_the_c_kernels(checkpoints, monkeypatch,
                                                                   arch, env, options):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load(checkpoints(arch), **options).module.fused is None


def test_the_c_decoder_refuses_any_plan_it_does_not_compute(checkpoints):
    """runs_plan: Llama's, Gemma 2/3's and gpt-oss's plans run in C, and so does any layer's own
    window, RoPE table, scale, soft-cap, attention sinks, norm kind or MLP kind; a norm of
    another epsilon, an MLP kind it has no kernel for, Cohere's centered norm or parallel block,
    a layer without RoPE, a recurrent mixer, an attention output gate or a residual scale in any
    one layer refuses the whole plan, as does a logit scale or divisor (Cohere2's plan is
    refused)."""
    llama, gemma2, gemma3, gpt_oss, cohere2 = (
        model_plan(load(checkpoints(arch)).module.spec)
        for arch in ("llama", "gemma2", "gemma3", "gpt_oss", "cohere2"))
    assert runs_plan(llama) and runs_plan(gemma2) and runs_plan(gemma3) and runs_plan(gpt_oss)
    assert not runs_plan(cohere2)
    layer, attention = llama.layers[0], llama.layers[0].attention
    taken = [replace(layer, attention=replace(attention, window=32)),
             replace(layer, attention=replace(attention, qk_norm=True)),
             replace(layer, sandwich=True), replace(layer, mlp="gelu_tanh"),
             replace(layer, norm=replace(layer.norm, offset=True)),
             replace(layer, attention=replace(attention, scale=0.2)),
             replace(layer, attention=replace(attention, rope=LOCAL_ROPE)),
             replace(layer, attention=replace(attention, softcap=5.0)),
             replace(layer, attention=replace(attention, sinks=True))]
    for first in taken:
        assert runs_plan(replace(llama, layers=(first,) + llama.layers[1:]))
    assert runs_plan(replace(llama, embedding_scale=8.0, final_softcap=30.0))
    refused = [replace(layer, norm=replace(layer.norm, eps=layer.norm.eps * 2)),
               replace(layer, mlp="relu"), replace(layer, parallel=True),
               replace(layer, norm=replace(layer.norm, centered=True)),
               replace(layer, attention=replace(attention, rope=None)),
               replace(layer, mixer=GATED_DELTA), replace(layer, mixer=MAMBA2),
               replace(layer, attention=replace(attention, output_gate=True)),
               replace(layer, residual_scale=0.5)]
    for plan in (llama, gemma2, gemma3):
        for first in refused:
            assert not runs_plan(replace(plan, layers=plan.layers[:1] + (first,)
                                         + plan.layers[2:]))
        assert not runs_plan(replace(plan, logit_scale=0.25))
        assert not runs_plan(replace(plan, logits_divisor=4.0))


def test_heads_the_c_rope_does_not_take_run_one_by_one(tmp_path, monkeypatch):
    """head_dim 24: the paged kernel takes it (a multiple of 8), the C RoPE (16) does not, so
    the per-layer path rotates with torch and the fused decoder must not run."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    model = load(build_tiny_checkpoint(tmp_path, hidden_size=96, num_heads=4))
    assert model.module.attention_name == "cpu-paged" and model.module.fused is None


def test_a_pipeline_gives_the_same_tokens_and_logits_fused_or_not(make_pipeline, monkeypatch):
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    prompts = [[5, 9, 14, 3, 22, 8] * n for n in (1, 5, 9)]
    outputs = []
    for fused in (True, False):
        pipe = make_pipeline()
        module = pipe.engine.runner.module
        assert module.fused is not None
        if not fused:
            module.fused = None
        streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 7,
                                            "return_logits": True}) for p in prompts]
        outputs.append([list(s)[-1] for s in streams] + [run(pipe, prompts[1] + [4, 4],
                                                             max_new_tokens=3, return_logits=True)])
    for a, b in zip(*outputs):
        assert a.output_ids == b.output_ids
        assert torch.equal(a.logits, b.logits)



def test_a_new_pool_at_the_old_pools_address_gets_its_own_layer_table(checkpoints, monkeypatch):
    """A pool freed and another allocated can start at the same address with its layers at other
    offsets (another block count): the fused decoder must write and read the new layers."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    module = load(checkpoints("llama")).module
    spec = module.spec
    assert module.fused is not None and spec.num_layers > 1
    batch = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    rows = spec.num_kv_heads * NUM_BLOCKS * BLOCK
    ids = torch.randint(3, spec.vocab_size, (len(batch.positions),),
                        generator=torch.Generator().manual_seed(1))

    def pool(memory: torch.Tensor, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer caches of `slots` rows each, laid out from the start of `memory`."""
        return [(memory[2 * i * slots:(2 * i + 1) * slots],
                 memory[(2 * i + 1) * slots:(2 * i + 2) * slots])
                for i in range(spec.num_layers)]

    def forward(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        with torch.inference_mode():
            return module(ids, batch.positions_tensor, kv, module.attention_metadata(batch))

    memory = torch.randn(4 * spec.num_layers * rows, spec.head_dim,
                         generator=torch.Generator().manual_seed(0))
    forward(pool(memory, 2 * rows))
    before = memory.clone()
    fused = forward(pool(memory, rows))
    module.fused, kept = None, module.fused
    try:
        layers = forward(pool(before, rows))
    finally:
        module.fused = kept
    assert torch.equal(fused, layers)
    assert torch.equal(memory, before)


def test_int32_positions_give_the_bits_of_the_layers(checkpoints, monkeypatch):
    """`CausalLM.forward` takes positions of any integer dtype (the per-layer path does): the C
    call must not read int32 positions as int64."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    module = load(checkpoints("llama")).module
    spec = module.spec
    batch = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    batch.positions_tensor = batch.positions_tensor.to(torch.int32)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g),
           torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g))
          for _ in range(spec.num_layers)]
    fused, _, fused_kv = _forward(module, batch, kv, fused=True)
    layers, _, layers_kv = _forward(module, batch, kv, fused=False)
    assert torch.equal(fused, layers)
    for (k1, v1), (k2, v2) in zip(fused_kv, layers_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_bad_ids_and_rows_never_reach_the_c_call(checkpoints, monkeypatch, bad):
    """The fused call reads each id's embedding row and each logit row unchecked:
    `forward_logits` refuses an id outside the vocabulary, a row outside the forward, a
    position count that is not the id count and a position past the RoPE table first, as the
    per-layer path's embedding and indexing would, and writes no KV."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    module = load(checkpoints("llama")).module
    spec = module.spec
    assert module.fused is not None
    batch = attention_batch([[3]], [(0, 2)], BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    kv = [(torch.zeros(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim),
           torch.zeros(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim))
          for _ in range(spec.num_layers)]
    meta = module.attention_metadata(batch)
    ids = [5, spec.vocab_size if bad == "vocab" else bad]
    with pytest.raises(IndexError, match="outside the vocabulary"):
        module.forward_logits(ids, batch.positions, kv, meta, [1])
    for rows in ([2], [-1], [0, 1, 1]):   # past the forward, negative, more rows than tokens
        with pytest.raises(IndexError, match="logit rows"):
            module.forward_logits([5, 6], batch.positions, kv, meta, rows)
    with pytest.raises(ValueError, match="positions"):
        module.forward_logits([5, 6, 7], batch.positions, kv, meta, [1])
    with pytest.raises(IndexError, match="past the RoPE table"):
        module.forward_logits([5, 6], [0, module.cos.shape[0]], kv, meta, [1])
    assert all(not k.any() and not v.any() for k, v in kv)


def test_a_reserved_scratch_serves_every_forward_up_to_its_rows(checkpoints, monkeypatch):
    """FusedDecoder.reserve(rows) maps this thread's scratch for forwards of up to `rows` rows:
    a forward of that many keeps it; one longer replaces it with a larger one."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    module = load(checkpoints("llama")).module
    spec, fused = module.spec, module.fused
    kv = [(torch.zeros(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim),
           torch.zeros(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim))
          for _ in range(spec.num_layers)]
    batch = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    rows = len(batch.positions)
    fused.reserve(rows)
    reserved = fused._buffers.floats
    with torch.inference_mode():
        module.forward_logits(list(range(3, 3 + rows)), batch.positions, kv,
                              module.attention_metadata(batch), ROWS)
    assert fused._buffers.floats is reserved
    fused.reserve(rows + 1)
    assert fused._buffers.floats.numel() > reserved.numel()


@pytest.mark.parametrize("huge", [False, True], ids=["heap", "huge-pages"])
def test_a_kept_scratch_gives_the_bits_of_a_fresh_one(checkpoints, monkeypatch, huge):
    """A thread keeps its forward scratch, grown to the largest forward's (in 2 MiB pages from
    HUGE_SCRATCH_BYTES on): a forward on the rows a longer one left (poisoned with NaN here)
    gives the logits and the KV of one on a fresh scratch."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    if huge:
        monkeypatch.setattr(fused_decoder, "HUGE_SCRATCH_BYTES", 0)
    module = load(checkpoints("llama")).module
    spec, fused = module.spec, module.fused
    assert fused is not None
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g),
           torch.randn(spec.num_kv_heads * NUM_BLOCKS * BLOCK, spec.head_dim, generator=g))
          for _ in range(spec.num_layers)]
    ids = torch.randint(3, spec.vocab_size, (81,), generator=g).tolist()

    def logits(batch, pool):
        with torch.inference_mode():
            return module.forward_logits(ids[:len(batch.positions)], batch.positions, pool,
                                         module.attention_metadata(batch), ROWS)

    long = attention_batch([[(7 * i + 3) % 20 for i in range(20)], [21, 22]], [(0, 80), (5, 1)],
                           BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    small = attention_batch(TABLES, SEQS, BLOCK, NUM_BLOCKS, spec.num_kv_heads)
    logits(long, [(k.clone(), v.clone()) for k, v in kv])
    kept = fused._buffers.floats
    with torch.inference_mode():
        kept.fill_(float("nan"))
    on_kept = [(k.clone(), v.clone()) for k, v in kv]
    from_kept = logits(small, on_kept)
    assert fused._buffers.floats is kept   # the longer forward's, reused
    fused._buffers.floats = None   # the next forward allocates a fresh one
    on_fresh = [(k.clone(), v.clone()) for k, v in kv]
    assert torch.equal(from_kept, logits(small, on_fresh))
    for (k1, v1), (k2, v2) in zip(on_kept, on_fresh):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
