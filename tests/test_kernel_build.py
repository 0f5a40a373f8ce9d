"""unikern's kernels built by unikern (platform/cuda_build.py, kernel_cache.Kernel): a
kernel text compiled once into a cubin kept on disk, found there by a second process
instead of compiled again, and launched through `mx.fast.precompiled_cuda_kernel` with
the shapes it reads as scalars; texts that read strides, and machines without NVRTC,
keep MLX's compiler. NVRTC from the test extras' wheels; no GPU is needed."""

import mlx.core as mx
import pytest

from unikern.platform import cuda_build, kernel_cache

SOURCE = """
  int i = threadIdx.x;
  if (i < x_shape[0] * x_shape[1]) out[i] = x[i] * (T)SCALE + w[i % w_shape[0]];
"""


@pytest.fixture
def builder(tmp_path):
    try:
        nvrtc, include = cuda_build.find_nvrtc()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return lambda arch="sm_90": kernel_cache.Builder(nvrtc, include, arch, tmp_path / "unikern")


def kernel(source: str = SOURCE) -> kernel_cache.Kernel:
    return kernel_cache.Kernel(kernel_cache.kernel_name("unikern_test", source), ("x", "w"), source, "", ("out",), True)


def arrays():
    return [mx.zeros((2, 3), dtype=mx.float32), mx.zeros((3,), dtype=mx.float32)]


def test_a_second_process_loads_the_cubin_instead_of_compiling(builder, tmp_path):
    before = dict(kernel_cache.BUILDS)
    name, cubin, shaped = builder().build(kernel(), arrays(), [("T", mx.float32), ("SCALE", 2)], [mx.float32])
    assert kernel_cache.BUILDS["compiled"] == before["compiled"] + 1
    assert shaped == [0, 1]  # both inputs' shapes are read: passed in this order
    assert cubin[:4] == b"\x7fELF" and (tmp_path / "unikern" / f"{name}.cubin").read_bytes() == cubin
    again = builder().build(kernel(), arrays(), [("T", mx.float32), ("SCALE", 2)], [mx.float32])
    assert again == (name, cubin, shaped)
    assert kernel_cache.BUILDS["compiled"] == before["compiled"] + 1
    assert kernel_cache.BUILDS["from_disk"] == before["from_disk"] + 1
    # a file that is no cubin (cut short, overwritten) is built again and replaced
    (tmp_path / "unikern" / f"{name}.cubin").write_bytes(b"junk")
    assert builder().build(kernel(), arrays(), [("T", mx.float32), ("SCALE", 2)], [mx.float32]) == again
    assert kernel_cache.BUILDS["compiled"] == before["compiled"] + 2
    # another template value, another GPU: another binary, under another name
    other = builder().build(kernel(), arrays(), [("T", mx.float32), ("SCALE", 3)], [mx.float32])[0]
    newer = builder("sm_100").build(kernel(), arrays(), [("T", mx.float32), ("SCALE", 2)], [mx.float32])[0]
    assert len({name, other, newer}) == 3


def test_the_wrap_file_holds_its_three_sections():
    assert sorted(cuda_build._sections()) == ["extern", "mlx", "prelude"]


def test_the_wrapping_passes_shapes_after_the_outputs():
    text, shaped = cuda_build.wrap_precompiled("k", SOURCE, "", [("x", "bfloat16", 2), ("w", "float32", 1)],
                                               [("out", "bfloat16")], [("T", "bfloat16"), ("SCALE", 2)])
    signature = text[text.index('extern "C"'):text.index(") {")]
    assert [p.strip() for p in signature.split("(", 1)[1].split(",")] == [
        "const __nv_bfloat16* x", "const float* w", "__nv_bfloat16* out", "int x_shape_0", "int x_shape_1",
        "int w_shape_0"]
    assert shaped == [0, 1]
    assert "const int x_shape[2] = {x_shape_0, x_shape_1};" in text and "using T = __nv_bfloat16;" in text


def test_the_launch_goes_through_the_precompiled_kernel(builder, monkeypatch):
    launches = []

    def precompiled(**kw):
        launches.append(kw)
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    monkeypatch.setattr(kernel_cache, "_builder", builder)
    k = kernel()
    x, w = arrays()
    for _ in range(2):
        k(inputs=[x, w], template=[("T", mx.float32), ("SCALE", 2)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(2, 3)], output_dtypes=[mx.float32])
    assert len(launches) == 2 and len(k._built) == 1  # built once in the process
    launch = launches[0]
    assert launch["scalars"] == [2, 3, 3] and launch["compiled_source"][:4] == b"\x7fELF"
    assert launch["name"].startswith(k.name) and launch["ensure_row_contiguous"] is True


def test_a_text_reading_strides_keeps_mlx_compiler(builder, monkeypatch):
    jit = []
    strided = "out[0] = x[x_strides[0]];"
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: lambda **call: jit.append(call) or [mx.zeros((1,))])
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: pytest.fail("precompiled a strided text"))
    monkeypatch.setattr(kernel_cache, "_builder", builder)
    k = kernel(strided)
    k(inputs=arrays(), template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
      output_dtypes=[mx.float32])
    assert len(jit) == 1


def test_no_builder_off_cuda():
    if mx.cuda.is_available():
        pytest.skip("a CUDA machine")
    kernel_cache._builder.cache_clear()
    assert kernel_cache._builder() is None
