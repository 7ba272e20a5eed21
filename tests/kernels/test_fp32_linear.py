"""The avx2 float32 GEMM (RTPKV_LINEAR=avx2): close to a float64 reference, the same bits for
every row count, offset and thread count, equal to oneDNN's on CPUs where oneDNN computes with
the same 8-lane vectors, and a pipeline on it gives the tokens of the onednn path."""

import pytest
import torch
import torch.nn.functional as F
from conftest import run

from rtpkv.kernels import fp32_linear
from rtpkv.kernels.cpu_build import cpu_flags
from rtpkv.kernels.linear import InferenceLinear, linear_path

from conftest import needs_c_kernels

pytestmark = needs_c_kernels  # these tests ask for the C kernels by name

# (in, out, bias): a layer of the tests' models, channels that are not whole panels, inputs
# over one K block of 1024 (the partial sums), a single output
SHAPES = [(64, 192, False), (100, 37, True), (2100, 70, True), (1408, 512, False), (64, 1, True)]
ROWS = (1, 2, 3, 4, 5, 6, 7, 13, 64, 129)
AVX2_ONLY = "avx512f" not in cpu_flags().split()


def _layer(in_features: int, out_features: int, bias: bool) -> torch.nn.Linear:
    torch.manual_seed(in_features * 7 + out_features)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_row_count_gives_the_bits_of_one_large_call(shape):
    layer = _layer(*shape)
    fast = InferenceLinear(layer, "avx2")
    x = torch.randn(300, shape[0])
    with torch.inference_mode():
        full = fast(x)
        reference = F.linear(x.double(), layer.weight.double(),
                             None if layer.bias is None else layer.bias.double())
        for rows in ROWS:
            for offset in (0, 5, 300 - rows):
                assert torch.equal(fast(x[offset:offset + rows]), full[offset:offset + rows])
    # float32 accumulation over up to 2100 inputs of unit scale
    assert (full.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert fast.min_rows == 1


def test_no_rows_give_an_empty_result():
    fast = InferenceLinear(_layer(64, 40, True), "avx2")
    assert fast(torch.empty(0, 64)).shape == (0, 40)


def test_strided_and_three_dimensional_inputs_give_the_bits_of_their_rows():
    fast = InferenceLinear(_layer(100, 37, True), "avx2")
    x = torch.randn(3, 5, 200)[..., ::2]
    with torch.inference_mode():
        assert torch.equal(fast(x), fast(x.reshape(15, 100)).view(3, 5, 37))


@pytest.mark.parametrize("x", [torch.randn(4, 64, dtype=torch.float64),
                               torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 63)],
                         ids=["float64", "bfloat16", "width"])
def test_inputs_the_kernel_cannot_read_are_refused(x):
    """The kernel reads float32 rows of in_features values: anything else would be read as
    such (past the end of a bfloat16 tensor), as F.linear refuses it."""
    fast = InferenceLinear(_layer(64, 40, True), "avx2")
    with pytest.raises(ValueError):
        fast(x)


def test_thread_counts_give_the_same_bits():
    layer = _layer(512, 1000, True)
    fast = InferenceLinear(layer, "avx2")
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [fast(x[:m]) for m in (1, 3, 40)]
        torch.set_num_threads(2)
        two = [fast(x[:m]) for m in (1, 3, 40)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_on_an_avx2_cpu_the_bits_are_onednns():
    """oneDNN's float32 GEMM on AVX2 chains FMAs over blocks of 1024 inputs, as the kernel does;
    where the CPU has AVX-512 oneDNN uses other kernels and only closeness is promised."""
    for shape in SHAPES[:-1]:   # a single output channel takes another oneDNN kernel
        layer = _layer(*shape)
        x = torch.randn(20, shape[0])
        with torch.inference_mode():
            ours = InferenceLinear(layer, "avx2")(x)
            theirs = InferenceLinear(layer, "onednn")(x)
        if AVX2_ONLY:
            assert torch.equal(ours, theirs), shape
        else:
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags,builds", [("fpu sse avx avx2", True), ("fpu avx2 fma", False)],
                         ids=["no FMA", "no compiler"])
def test_auto_takes_avx2_only_where_the_kernel_runs(monkeypatch, flags, builds):
    monkeypatch.setattr(fp32_linear, "cpu_flags", lambda: flags)
    if not builds:
        monkeypatch.setattr(fp32_linear, "library", lambda: None)
    assert not fp32_linear.available()
    assert linear_path(torch.float32, torch.device("cpu"), "auto") != "avx2"
    with pytest.raises(ValueError, match="RTPKV_LINEAR=avx2 needs a CPU with AVX2 and FMA"):
        linear_path(torch.float32, torch.device("cpu"), "avx2")


def test_packing_pads_channels_to_whole_panels():
    w = torch.arange(3 * 5, dtype=torch.float32).view(5, 3)
    packed = fp32_linear.pack(w)
    assert packed.shape == (1, 3, fp32_linear.PANEL)
    assert torch.equal(packed[0, :, :5], w.t()) and not packed[0, :, 5:].any()
    assert fp32_linear.pad_bias(torch.ones(5)).shape == (fp32_linear.PANEL,)


def test_a_pipeline_on_avx2_gives_the_tokens_and_logits_of_onednn(make_pipeline, monkeypatch):
    outputs = {}
    for path in ("onednn", "avx2"):
        monkeypatch.setenv("RTPKV_LINEAR", path)
        pipe = make_pipeline()
        assert pipe.engine.runner.module.linear_path == path
        outputs[path] = [run(pipe, [5, 9, 14, 3, 22, 8] * n, max_new_tokens=6, return_logits=True)
                         for n in (1, 7)]
    for a, b in zip(outputs["onednn"], outputs["avx2"]):
        assert a.output_ids == b.output_ids
        if AVX2_ONLY:
            assert torch.equal(a.logits, b.logits)
        else:
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
