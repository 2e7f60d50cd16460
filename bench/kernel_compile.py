"""Compile the paged decode and tile commit kernels' CUDA source the way MLX's ``mx.fast.cuda_kernel`` wraps it
(header, ``__global__`` signature from the input names, template constants, body) with nvcc for
sm_90a, and print ptxas's resource report (registers, spills, stack) per configuration; with
``--sass DIR`` also keep the cubins and their SASS (needs cuobjdump). Needs nvcc, no GPU.

    python3 bench/kernel_compile.py                  # the default configurations
    python3 bench/kernel_compile.py --sass /tmp/sass
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metal.cuda.commit import HEADER as COMMIT_HEADER, INPUTS as COMMIT_INPUTS, SOURCE as COMMIT_SOURCE  # noqa: E402
from metal.cuda.paged_decode import ATTENTION_INPUTS, ATTENTION_OUTPUTS, ATTENTION_SOURCE, HEADER, MMA_HEADER, \
    MMA_SOURCE  # noqa: E402
from metal.records import RECORD_FIELDS  # noqa: E402

PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"
TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "uint32_t", "int32": "int32_t"}
INPUT_TYPES = ["QT", "WT", "WT", "float16", "uint32", "float16", "float16", "float16", "uint32", "float16",
               "float16", "float16", "int32", "int32", "int32", "int32", "float32"]


def source(kind: str, template: dict) -> str:
    if kind == "commit":
        ins = [f"    const {TYPES[t]}* {n}" for n, t in zip(COMMIT_INPUTS, ("float16", "float16", "int32", "int32"))]
        outs = [f"    {'uint32_t' if n.endswith('codes') else '__half'}* {n}" for n in RECORD_FIELDS]
        consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
        return (PRELUDE + COMMIT_HEADER + "\nnamespace mlx { namespace core { namespace cu {\n__global__ void kernel(\n"
                + ",\n".join(ins + outs) + ") {\n" + consts + COMMIT_SOURCE + "\n}\n}}}\n")
    ins = []
    for name, ty in zip(ATTENTION_INPUTS, INPUT_TYPES):
        ty = TYPES[template[ty]] if ty in ("QT", "WT") else TYPES[ty]
        ins.append(f"    const {ty}* {name}")
    outs = [f"    float* {name}" for name in ATTENTION_OUTPUTS]
    consts = "".join(f"  using {k} = {TYPES[v]};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                     for k, v in template.items())
    header, body = (HEADER + MMA_HEADER, MMA_SOURCE) if kind == "mma" else (HEADER, ATTENTION_SOURCE)
    return (PRELUDE + header + "\nnamespace mlx { namespace core { namespace cu {\n__global__ void kernel(\n" +
            ",\n".join(ins + outs) + ") {\n" + consts + body + "\n}\n}}}\n")


def compile_one(kind: str, template: dict, sass_dir: Path | None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(source(kind, template))
        cubin = Path(tmp) / "k.cubin"
        done = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
                               "-std=c++17", "-o", str(cubin), str(cu)], capture_output=True, text=True)
        if done.returncode:
            return "FAILED\n" + done.stderr[-6000:]
        report = " ".join(re.findall(r"(Used \d+ registers.*|\d+ bytes stack frame.*)", done.stderr))
        if sass_dir is not None:
            sass_dir.mkdir(parents=True, exist_ok=True)
            tag = "-".join(f"{k}{v}" for k, v in template.items())
            shutil.copy(cubin, sass_dir / f"{kind}-{tag}.cubin")
            if shutil.which("cuobjdump"):
                sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
                (sass_dir / f"{kind}-{tag}.sass").write_text(sass)
                counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HMMA", "LDS", "LDL", "STL", "LOP3",
                                                                            "HFMA2", "PRMT", "LDGSTS", "BAR")}
                report += f"  sass {counts}"
        return report


CONFIGS = [
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=4, VB=2, NR=4, NST=2, FK=0, FV=0, FINAL=1)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=4, VB=2, NR=4, NST=2, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=4, VB=2, NR=4, NST=2, FK=1, FV=1, FINAL=0)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=4, VB=2, NR=4, NST=3, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="bfloat16", WT="float16", D=128, G=128, KB=4, VB=2, NR=8, NST=2, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=2, VB=2, NR=4, NST=2, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=128, KB=8, VB=8, NR=4, NST=2, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="float16", WT="float16", D=128, G=64, KB=4, VB=4, NR=2, NST=2, FK=0, FV=0, FINAL=0)),
    ("mma", dict(QT="float16", WT="float32", D=128, G=64, KB=8, VB=2, NR=1, NST=2, FK=0, FV=0, FINAL=0)),
    ("scalar", dict(QT="float16", WT="float16", D=128, G=128, KB=4, VB=2, NR=4)),
    ("commit", dict(G=128, D=128, ITERS=8, ROWS=4, WIN=1, NH=8, MK=1)),
    ("commit", dict(G=128, D=128, ITERS=8, ROWS=4, WIN=1, NH=8, MK=0)),
    ("commit", dict(G=128, D=128, ITERS=8, ROWS=4, WIN=0, NH=1, MK=1)),
    ("commit", dict(G=128, D=128, ITERS=8, ROWS=8, WIN=0, NH=1, MK=1)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", type=Path, default=None)
    ap.add_argument("--only", default=None, help="only configurations of this kind (mma, scalar, commit)")
    args = ap.parse_args()
    for kind, template in CONFIGS:
        if args.only and kind != args.only:
            continue
        tag = " ".join(f"{k}={v}" for k, v in template.items())
        print(f"{kind:6s} {tag}: {compile_one(kind, template, args.sass)}", flush=True)


if __name__ == "__main__":
    main()
