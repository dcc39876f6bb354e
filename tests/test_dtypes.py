"""Host arrays for checkpoint data: dtype table, casts equal to torch's, torch round trips,
and conversions that never import torch."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.io.dtypes import arrays_to_torch, cast, dtype_info, dtype_of, dtype_of_code, to_numpy, to_torch

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]
SPECIAL = [0.0, -0.0, 1.0, -1.5, 1e-45, -1e-40, 6.1e-5, 65504.0, 65520.0, 3.0e38, -3.39e38, float("inf"), -float("inf")]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_arrays_cross_to_torch_and_back_bit_for_bit(dtype):
    source = (torch.randn(3, 5) * 8).to(dtype)
    array = to_numpy(source)
    assert dtype_of(array).name == str(dtype).removeprefix("torch.") and array.shape == (3, 5)
    assert array.tobytes() == raw(source)
    back = to_torch(array)
    assert back.dtype == dtype and back.shape == (3, 5) and raw(back) == raw(source)
    assert back.data_ptr() == array.ctypes.data  # shared, not copied
    info = dtype_info(dtype)
    assert dtype_of_code(info.code) is info and info.itemsize == source.element_size()
    scalar = to_torch(array[1, 2, ...])  # a 0-d array stays 0-d
    assert scalar.shape == () and raw(scalar) == raw(source[1, 2])


def test_read_only_and_strided_arrays_are_copied_for_torch():
    frozen = np.frombuffer(bytes(range(16)), dtype=np.float32)
    assert not frozen.flags.writeable and raw(to_torch(frozen)) == frozen.tobytes()
    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    assert torch.equal(to_torch(strided), torch.arange(12).reshape(3, 4)[:, ::2])
    nested = arrays_to_torch({"a": [np.ones(2, np.float32), (np.zeros((), np.int64), 3)], "b": "text"})
    assert torch.equal(nested["a"][0], torch.ones(2)) and nested["a"][1][0].shape == () and nested["a"][1][1] == 3


@settings(max_examples=40, deadline=None)
@given(
    target=st.sampled_from(["bfloat16", "float16"]),
    values=st.lists(st.floats(width=32, allow_nan=False) | st.sampled_from(SPECIAL), min_size=1, max_size=64),
)
def test_casts_round_like_torch(target, values):
    """The fp32 export casts with numpy; the bits must be torch's `.to(dtype)`."""
    source = torch.tensor(values, dtype=torch.float32)
    ours = cast(source.numpy(), target)
    assert ours.tobytes() == raw(source.to(getattr(torch, target)))


def test_cast_of_nan_stays_nan():
    source = np.array([np.nan, -np.nan], dtype=np.float32)
    for target in ("bfloat16", "float16"):
        assert np.isnan(cast(source, target).astype(np.float32)).all()


def test_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        dtype_info("complex64")
    with pytest.raises(ValueError, match="unknown safetensors dtype 'C64'"):
        dtype_of_code("C64")
    with pytest.raises(ValueError, match="complex64 cannot be stored"):
        dtype_of(np.zeros(1, np.complex64))


def test_conversions_run_without_importing_torch(tmp_path):
    """to-universal, to-fp32 and inspect from the command line, and reading the result, in a
    process where importing torch is made to fail."""
    from universal_helpers import save_synthetic

    from zeroshard.checkpoint.testing import pattern
    from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

    specs = [[ParamSpec.of("w", (40, 3), "bf16"), ParamSpec.of("b", (7,), "bf16")]]
    layout = build_layout(specs, 3, LayoutPolicy.deepspeed())
    checkpoint = save_synthetic(tmp_path / "ckpt", layout, block_size=64)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from zeroshard.cli.main import main
        assert main(["to-universal", r"{checkpoint}", r"{tmp_path / 'u'}", "--no-progress"]) == 0
        assert main(["to-fp32", r"{tmp_path / 'u'}", r"{tmp_path / 'f'}", "--dtype", "bf16", "--no-progress"]) == 0
        assert main(["to-fp32", r"{checkpoint}", r"{tmp_path / 'g'}", "--no-progress"]) == 0
        assert main(["inspect", r"{checkpoint}"]) == 0 and main(["inspect", r"{checkpoint}", "--verify"]) == 0
        from zeroshard.checkpoint.universal.read import open_universal
        with open_universal(r"{tmp_path / 'u'}") as ckpt:
            ckpt.read_param("w", "exp_avg").tofile(r"{tmp_path / 'exp_avg.bin'}")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "step: 7" in done.stdout and "every checksum, binding and digest matches" in done.stdout, done.stdout
    from safetensors.torch import load_file

    assert torch.equal(torch.from_numpy(np.fromfile(tmp_path / "exp_avg.bin", dtype=np.float32)), pattern("w", "exp_avg", 120))
    assert torch.equal(load_file(tmp_path / "g" / "model.safetensors")["b"], pattern("b", "fp32", 7))
    exported = load_file(tmp_path / "f" / "model.safetensors")["w"]
    assert exported.dtype == torch.bfloat16 and torch.equal(exported.reshape(-1), pattern("w", "fp32", 120).to(torch.bfloat16))


def test_tensors_from_arrays_have_torch_strides():
    """numpy may give an empty or size-1 dimension any stride; torch views of such refuse."""
    for dtype in ("float32", "bfloat16"):
        for shape in ((0, 4), (4, 0), (6, 1)):
            array = cast(np.frombuffer(bytearray(4 * math.prod(shape)), dtype=np.float32), dtype).reshape(shape)
            tensor = to_torch(array)
            assert tensor.shape == shape and tensor.is_contiguous()
            assert tensor.view(torch.uint8).numel() == array.nbytes
