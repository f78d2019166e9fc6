"""Builds vllm_kvq._C: C++ CPU kernels always; CUDA kernels too when both nvcc and a CUDA
build of torch are present (so the same package builds here and on a GPU host)."""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    if os.environ.get("KVQ_NO_CUDA") == "1":
        return False
    return bool(__import__("torch").version.cuda) and cpp_extension.CUDA_HOME is not None


sources = ["csrc/torch_bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
# -ffp-contract=off: quantization must round exactly like the PyTorch reference; kernels
# that want fused multiply-add ask for it explicitly.
cxx = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
define_macros = []
ext_cls = cpp_extension.CppExtension
extra = {"cxx": cxx}
if want_cuda():
    # compile_check.cu only instantiates the kernels for scripts/check_cuda_compile.sh.
    sources += [f for f in sorted(glob.glob("csrc/cuda/*.cu"))
                if os.path.basename(f) != "compile_check.cu"]
    ext_cls = cpp_extension.CUDAExtension
    define_macros.append(("KVQ_WITH_CUDA", "1"))
    # No --use_fast_math: write_cache must divide and round exactly like the CPU kernels and
    # the reference (IEEE division, no flush-to-zero); the attention kernels ask for fast
    # exp2 / fused multiply-add explicitly. KVQ_CUDA_ARCHS="90" builds one target only.
    archs = os.environ.get("KVQ_CUDA_ARCHS", "80,90").split(",")
    extra["nvcc"] = ["-O3", "-std=c++17", "-lineinfo", "--threads=2"] + [
        f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]

setup(
    name="vllm-kvq",
    version="0.1.0",
    description="Quantized KV caches (fp8, int8/4/2, KIVI, mixed precision) for vLLM",
    packages=find_packages(include=["vllm_kvq", "vllm_kvq.*"]),
    package_data={"vllm_kvq": ["calibrations/*.safetensors"]},  # shipped nuq calibrations
    python_requires=">=3.10",
    ext_modules=[ext_cls("vllm_kvq._C", sources, include_dirs=[os.path.join(ROOT, "csrc")],
                         define_macros=define_macros, extra_compile_args=extra,
                         extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    entry_points={
        "console_scripts": ["vllm-kvq=vllm_kvq.cli:main"],
        "vllm.general_plugins": ["vllm_kvq=vllm_kvq.plugin:register"],
        # API server only, and only when VLLM_PLUGINS names it (`vllm-kvq serve` does).
        "vllm.endpoint_plugins": ["vllm_kvq_routes=vllm_kvq.serving:KVQEndpointPlugin"],
    },
)
