"""The kernels' source files (metal/sources.py): every file under metal/cuda/src and metal/msl/src
is the text of one module constant, every text handed to MLX names the inputs and outputs of its
launch and the header function it enters through, and the wheel ships every file."""

from __future__ import annotations

import fnmatch
import importlib
import re
from pathlib import Path

import pytest

from metal import sources

CUDA_PAGED, CUDA_COMMIT, CUDA_RAGGED = "metal.cuda.paged_decode", "metal.cuda.commit", "metal.cuda.ragged_decode"
CUDA_ROTATE = "metal.cuda.rotate"
MSL_PAGED, MSL_COMMIT = "metal.msl.paged_decode", "metal.msl.commit"

# backend -> {source file: (module, the constant that holds its text)}
FILES = {
    "cuda": {
        "paged_decode.cuh": (CUDA_PAGED, "HEADER"),
        "paged_decode_scalar.cu": (CUDA_PAGED, "ATTENTION_SOURCE"),
        "paged_decode_combine.cu": (CUDA_PAGED, "COMBINE_SOURCE"),
        "paged_decode_mma.cuh": (CUDA_PAGED, "MMA_HEADER"),
        "paged_decode_mma_setup.cu": (CUDA_PAGED, "MMA_SETUP"),
        "paged_decode_mma_tiles.cu": (CUDA_PAGED, "MMA_TILES"),
        "commit.cuh": (CUDA_COMMIT, "HEADER"),
        "commit.cu": (CUDA_COMMIT, "SOURCE"),
        "ragged_decode.cuh": (CUDA_RAGGED, "HEADER"),
        "ragged_decode.cu": (CUDA_RAGGED, "ATTENTION_SOURCE"),
        "ragged_decode_combine.cu": (CUDA_RAGGED, "COMBINE_SOURCE"),
        "rotate.cu": (CUDA_ROTATE, "SOURCE"),
    },
    "msl": {
        "paged_decode.h": (MSL_PAGED, "HEADER"),
        "paged_decode.metal": (MSL_PAGED, "ATTENTION_SOURCE"),
        "paged_decode_combine.metal": (MSL_PAGED, "COMBINE_SOURCE"),
        "commit.h": (MSL_COMMIT, "HEADER"),
        "commit.metal": (MSL_COMMIT, "SOURCE"),
    },
}

# every (header, body) pair handed to mx.fast.cuda_kernel / metal_kernel: its module and constant,
# the launch's input and output names (MLX declares them in the signature it writes around the
# body), and the header function the body enters through (None: the body calls none)
ATTENTION_IO = ("ATTENTION_INPUTS", "ATTENTION_OUTPUTS")
COMBINE_IO = ("COMBINE_INPUTS", "COMBINE_OUTPUTS")
COMMIT_IO = ("INPUTS", "RECORD_FIELDS")
KERNELS = [
    (CUDA_PAGED, "_SCALAR_TEXT", ATTENTION_IO, "kv_code"),
    (CUDA_PAGED, "_MMA_TEXT", ATTENTION_IO, "kv_mma"),
    (CUDA_PAGED, "_COMBINE_TEXT", COMBINE_IO, "kv_store"),
    (CUDA_COMMIT, "KERNEL_TEXT", COMMIT_IO, "kc_matrix"),
    (CUDA_RAGGED, "_ATTENTION_TEXT", ATTENTION_IO, "rd_unpack"),
    (CUDA_RAGGED, "_COMBINE_TEXT", COMBINE_IO, "rd_store"),
    (CUDA_ROTATE, "KERNEL_TEXT", ("INPUTS", "OUTPUTS"), "kv_store"),
    (MSL_PAGED, "_ATTENTION_TEXT", ATTENTION_IO, "kv_code"),
    (MSL_PAGED, "_COMBINE_TEXT", COMBINE_IO, None),
    (MSL_COMMIT, "KERNEL_TEXT", COMMIT_IO, "kc_matrix"),
]


@pytest.mark.parametrize("backend", sorted(FILES))
def test_every_source_file_is_one_module_constants_text(backend):
    assert sources.names(backend) == sorted(FILES[backend])
    for name, (module, constant) in FILES[backend].items():
        text = sources.source(backend, name)
        assert text.strip(), name
        assert getattr(importlib.import_module(module), constant) == text, (name, module, constant)


def test_the_tensor_core_body_is_its_two_halves_in_order():
    paged = importlib.import_module(CUDA_PAGED)
    assert paged.MMA_SOURCE == sources.source("cuda", "paged_decode_mma_setup.cu") + sources.source(
        "cuda", "paged_decode_mma_tiles.cu")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError):
        sources.source("hip", "paged_decode.cuh")


@pytest.mark.parametrize("module,constant,io,entry", KERNELS, ids=[f"{m}.{c}" for m, c, _, _ in KERNELS])
def test_each_kernel_text_names_its_launch_arguments_and_entry(module, constant, io, entry):
    mod = importlib.import_module(module)
    header, body = getattr(mod, constant)
    assert header.strip() and body.strip()
    names = [*getattr(mod, io[0]), *getattr(mod, io[1])]
    missing = [n for n in names if not re.search(rf"\b{n}\b", body)]
    assert not missing, f"{module}.{constant}: the body never names {missing}"
    if entry is not None:
        assert re.search(rf"\b{entry}\s*\(", header), f"the header defines no {entry}"
        assert re.search(rf"\b{entry}\s*[<(]", body), f"the body never calls {entry}"


def test_the_wheel_ships_every_source_file():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"metal", "metal.cuda", "metal.msl"} <= set(project["packages"])
    globs = project["package-data"]["metal"]
    for backend in FILES:
        for name in sources.names(backend):
            assert any(fnmatch.fnmatch(f"{backend}/src/{name}", g) for g in globs), f"{backend}/src/{name}"
