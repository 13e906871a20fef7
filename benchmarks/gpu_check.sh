#!/usr/bin/env bash
# gpu_check.sh: one prepared check of localspec on a CUDA machine, written to one JSON file.
#
# What it measures (benchmarks/gpu_check.py does the measuring; see its docstring):
#   * llama.cpp built with CUDA for this GPU only, from llama-cpp-python 0.3.36's vendored
#     sources (build time recorded);
#   * random-weight Llama-shaped models made there (~1B and ~8B, Q4_K_M: the tests' GGUF writer,
#     localspec/models/tiny.py, then llama.cpp's quantizer), no download;
#   * the verification cost curve, one pass of 1 to 256 tokens, fully offloaded and with half
#     the layers on the CPU (where GGML_OP_OFFLOAD_MIN_BATCH moves batches of 32+ to the GPU);
#   * host milliseconds per step at GPU step rates through localspec's engine;
#   * acceptance bounded two ways, since random weights give random text: the target as its own
#     draft (100% but for near-ties, where a batched and a one-token pass of quantized weights
#     may rank the best two differently) and a different random draft (0%);
#   * engine/placement.py's decision (--gpu-layers auto) against what llama.cpp loaded and the
#     VRAM it used, real and on a simulated smaller card, and against llama.cpp's own no_alloc
#     dry runs of 1B and 70B shapes (sparse header files, no weights);
#   * NVML's VRAM reading (localspec/monitor.py) and llama.cpp's own (engine/llama_devices.py,
#     which placement reads first) against nvidia-smi's.
#
# How long: under 8 minutes on one H200 with 16 cores (build ~3-4 min, the rest time-boxed:
# steps that would overrun the budget are skipped and named in the JSON).
#
# How to run:
#   here (needs the package registry):   bash benchmarks/gpu_check.sh --pack
#       makes .gpu_check/ (ignored by git, ~4 MB): the llama.cpp sources (the sdist is 77 MB,
#       its .git pack and vendored models/docs/tools are left out) and the pure-Python wheels
#       the device lacks (gguf, diskcache, platformdirs);
#   on the device machine (no network; carry .gpu_check):   bash benchmarks/gpu_check.sh OUT.json
#       (the device tool: command "bash benchmarks/gpu_check.sh $OUT/gpu_check.json",
#       carry [".gpu_check"], timeout_s 600)
#   here, to exercise the Python half on the CPU with tiny models:
#       bash benchmarks/gpu_check.sh --cpu-dry-run OUT.json
# GPU_CHECK_WORK (default /tmp/localspec-gpu-check) holds the build and the models;
# GPU_CHECK_BUDGET (seconds, default 470) bounds the whole run; GPU_CHECK_CUDA_ARCH (default
# native: this machine's GPU) is CMake's CUDA architecture list.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PACK="$ROOT/.gpu_check"
SDIST_NAME=llama_cpp_python-0.3.36
SRC_TAR="$PACK/$SDIST_NAME-src.tar.gz"
WORK=${GPU_CHECK_WORK:-/tmp/localspec-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-470}

die() { echo "gpu_check: $*" >&2; exit 1; }

pack() {
    local py="$ROOT/.venv/bin/python"
    [ -x "$py" ] || py=python3
    PACK_TMP=$(mktemp -d)
    trap 'rm -rf "$PACK_TMP"' EXIT
    local tmp=$PACK_TMP
    local sdist=${1:-}
    if [ -z "$sdist" ]; then
        "$py" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
        sdist="$tmp/$SDIST_NAME.tar.gz"
    fi
    [ -f "$sdist" ] || die "no sdist at $sdist"
    mkdir -p "$PACK/wheels"
    tar xzf "$sdist" -C "$tmp"
    local v="$SDIST_NAME/vendor/llama.cpp"
    local excludes=(--exclude="$SDIST_NAME/.git" --exclude="$SDIST_NAME/docs"
        --exclude="$SDIST_NAME/examples" --exclude="$SDIST_NAME/tests"
        --exclude="$SDIST_NAME/docker")
    for d in models docs tools examples tests benches media gguf-py scripts conversion \
             .devops .github; do
        excludes+=(--exclude="$v/$d")
    done
    # Backends other than the CPU and CUDA ones: CMake only enters the enabled ones.
    for b in vulkan sycl opencl hexagon metal et webgpu openvino cann virtgpu musa hip zdnn \
             rpc blas zendnn; do
        excludes+=(--exclude="$v/ggml/src/ggml-$b")
    done
    tar czf "$SRC_TAR.tmp" -C "$tmp" "${excludes[@]}" "$SDIST_NAME"
    mv "$SRC_TAR.tmp" "$SRC_TAR"
    # The versions this checkout's venv runs, pure Python (py3-none-any) so any CPython takes them.
    local pins
    pins=$("$py" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("gguf", "diskcache", "platformdirs")))
EOF
)
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$PACK/wheels" $pins
    if ! git -C "$ROOT" check-ignore -q "$PACK" 2>/dev/null; then
        echo "/.gpu_check/" >>"$ROOT/.git/info/exclude"
    fi
    du -sh "$PACK"
    echo "carry .gpu_check and run: bash benchmarks/gpu_check.sh OUT.json"
}

cuda_hints() {
    # CMake takes cuBLAS and the driver library from the CUDA toolkit. An image whose toolkit
    # lacks them may have cuBLAS in PyTorch's pip packages (nvidia-cublas) and the driver's
    # libcuda.so.1 only: print the CMake flags that point there.
    "$1" - <<'EOF'
import glob, os, site, subprocess
flags = []
for root in site.getsitepackages():
    hits = sorted(glob.glob(os.path.join(root, "nvidia/cu*/lib/libcublas.so*"))
                  + glob.glob(os.path.join(root, "nvidia/cublas/lib/libcublas.so*")))
    if hits:
        lib = os.path.dirname(hits[0])
        inc = os.path.join(os.path.dirname(lib), "include")
        lt = sorted(glob.glob(os.path.join(lib, "libcublasLt.so*")))
        flags += [f"-DCUDA_cublas_LIBRARY={hits[0]}", f"-DCMAKE_CUDA_FLAGS=-I{inc}",
                  f"-DCMAKE_CXX_FLAGS=-I{inc}"] + [f"-DCUDA_cublasLt_LIBRARY={lt[0]}"] * bool(lt)
        break
cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
drivers = [line.split(" => ")[-1] for line in cache.splitlines() if "libcuda.so" in line]
drivers += sorted(glob.glob("/usr/local/nvidia/lib64/libcuda.so*"))
if drivers:
    flags.append(f"-DCUDA_cuda_driver_LIBRARY={drivers[0].strip()}")
print(" ".join(flags))
EOF
}

build_llama() {
    # llama.cpp alone (no common, tools or mtmd), CUDA for the GPU in this machine only, and
    # without the flash-attention kernels (the engine does not enable flash attention): the
    # slowest part of the check, so the fewest kernels. llama-cpp-python's own Python package
    # is then pointed at the build (its lib/ folder is where llama_cpp and llama_cpp._ggml look).
    local py=$1 src="$WORK/$SDIST_NAME"
    rm -rf "$src" "$WORK/build" && tar xzf "$SRC_TAR" -C "$WORK"
    local flags=(-S "$src/vendor/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
        -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_CUDA=ON
        -DCMAKE_CUDA_ARCHITECTURES="${GPU_CHECK_CUDA_ARCH:-native}" -DGGML_CUDA_FA=OFF
        -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
        -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF)
    if ! cmake "${flags[@]}" >"$WORK/cmake.log" 2>&1; then
        local hints
        hints=$(cuda_hints "$py")
        [ -n "$hints" ] || { tail -30 "$WORK/cmake.log"; die "cmake failed"; }
        echo "gpu_check: cmake failed; again with $hints" >&2
        rm -rf "$WORK/build"
        # shellcheck disable=SC2086
        cmake "${flags[@]}" $hints >"$WORK/cmake.log" 2>&1 \
            || { tail -30 "$WORK/cmake.log"; die "cmake failed"; }
    fi
    cmake --build "$WORK/build" -j "$(nproc)" --target llama >"$WORK/build.log" 2>&1 \
        || { tail -40 "$WORK/build.log"; die "build failed"; }
    mkdir -p "$src/llama_cpp/lib"
    for so in "$WORK"/build/bin/*.so*; do
        ln -sf "$so" "$src/llama_cpp/lib/"
    done
}

main() {
    case "${1:-}" in
        --pack) shift; pack "$@"; return ;;
        --cpu-dry-run)
            [ $# -eq 2 ] || die "usage: bash benchmarks/gpu_check.sh --cpu-dry-run OUT.json"
            local py="$ROOT/.venv/bin/python"
            [ -x "$py" ] || die "no .venv here"
            mkdir -p "$WORK"
            PYTHONPATH="$ROOT" "$py" "$ROOT/benchmarks/gpu_check.py" --cpu-dry-run \
                --out "$2" --work "$WORK/cpu" --budget "$BUDGET"
            return ;;
        ""|-h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d'; return ;;
    esac
    [ $# -eq 1 ] || die "usage: bash benchmarks/gpu_check.sh OUT.json"
    local out
    out=$(realpath -m "$1")
    [ -f "$SRC_TAR" ] || die "$SRC_TAR missing: run 'bash benchmarks/gpu_check.sh --pack' where \
the package registry is reachable, and carry .gpu_check"
    command -v nvcc >/dev/null || die "no nvcc on PATH"
    command -v nvidia-smi >/dev/null || die "no nvidia-smi on PATH"
    local py=${PYTHON:-python3}
    mkdir -p "$WORK"
    local start=$SECONDS
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$PACK"/wheels/*.whl
    build_llama "$py"
    local built=$((SECONDS - start))
    echo "gpu_check: llama.cpp built in ${built}s" >&2
    PYTHONUNBUFFERED=1 PYTHONPATH="$WORK/site:$WORK/$SDIST_NAME:$ROOT" \
        "$py" "$ROOT/benchmarks/gpu_check.py" --out "$out" --work "$WORK" \
        --budget $((BUDGET - built)) --build-seconds "$built"
}

main "$@"
