#!/usr/bin/env bash
# Installs the optional frameworks of lesson 05d on top of requirements.txt:
#   - tensorflow-cpu (and CMake for the build), pinned in requirements-frameworks.txt, and tf-keras;
#   - Horovod 0.28.1, built here from its source release: no Horovod wheel is published, its last
#     release predates torch 2.14, and its C++ extension must be compiled against the torch that
#     is installed. The build (about 4 minutes on 2 cores) runs once; the wheel is kept in
#     ${XDG_CACHE_HOME:-~/.cache}/dtcourse/wheels, outside the repository, so that a second run
#     installs it in seconds.
#
# Run from anywhere:  bash 05-advanced/d-other-frameworks/install_frameworks.sh
# Variables: DTCOURSE_WHEELS (the cache folder), HOROVOD_REBUILD=1 (ignore a cached wheel).
set -euo pipefail
cd "$(dirname "$0")/../.."
HOROVOD_VERSION=0.28.1
TF_KERAS_VERSION=2.21.0  # = tensorflow-cpu's version in requirements-frameworks.txt

python -m pip install -q -r requirements-frameworks.txt
# Without its declared dependency `tensorflow`: tensorflow-cpu provides the same modules.
python -m pip install -q --no-deps "tf-keras==$TF_KERAS_VERSION"

# The extension links against torch's C++ library: one wheel per (Horovod, torch, Python).
tag=$(python -c 'import sys, torch; print(f"torch{torch.__version__.split(chr(43))[0]}"
                                           f"-cp{sys.version_info[0]}{sys.version_info[1]}")')
cache="${DTCOURSE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/dtcourse/wheels}"
wheels="$cache/horovod-$HOROVOD_VERSION-$tag"
wheel=$(ls "$wheels"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)

if [ -z "$wheel" ] || [ "${HOROVOD_REBUILD:-0}" = 1 ]; then
    echo "building Horovod $HOROVOD_VERSION for $tag (CPU, gloo, no MPI); cache: $wheels"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python -m pip download -q "horovod==$HOROVOD_VERSION" --no-deps --no-binary :all: -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"

    # Three edits make 0.28.1 build against torch 2.14; each is checked, so a changed source fails
    # here instead of deep in the compiler output.
    patch_file() {  # file, sed expression, text that must be present afterwards
        sed -i -e "$2" "$src/$1"
        grep -q -- "$3" "$src/$1" || { echo "patching $1 failed: $3 not found" >&2; exit 1; }
    }
    # 1. torch's headers need C++20; Horovod forces C++14 in two places.
    patch_file CMakeLists.txt 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' \
        '^set(CMAKE_CXX_STANDARD 20)'
    patch_file horovod/torch/CMakeLists.txt \
        's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' 'set(CMAKE_CXX_STANDARD 20)'
    # 2. The CUDA build of torch makes Horovod build its GPU kernels, which fails without the CUDA
    #    toolkit's headers: declare torch CPU-only to the build (the CPU ops work on any torch).
    cuda_check='print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None))'
    patch_file cmake/Modules/FindPytorch.cmake "s/$cuda_check else False)/print(False)/" \
        'from torch.utils.cpp_extension import CUDA_HOME; print(False)'
    # 3. CMake 4 rejects cmake_minimum_required below 3.5 in the bundled libraries: build with the
    #    CMake 3 that requirements-frameworks.txt installed beside this Python (first on PATH).
    PATH="$(python -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
    cmake --version | head -n 1 | grep -q 'version 3\.' || { echo "CMake 3 needed" >&2; exit 1; }

    (cd "$src" && MAKEFLAGS="-j$(nproc)" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        python -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" .)
    mkdir -p "$wheels"
    rm -f "$wheels"/horovod-*.whl
    wheel="$wheels/$(basename "$work"/dist/horovod-*.whl)"
    cp "$work"/dist/horovod-*.whl "$wheel.tmp" && mv "$wheel.tmp" "$wheel"  # never half a wheel
fi

python -m pip install -q --no-deps --force-reinstall "$wheel"
# Fails if the extension did not load or lacks PyTorch or gloo support.
TF_CPP_MIN_LOG_LEVEL=2 TF_ENABLE_ONEDNN_OPTS=0 python - <<'EOF'
import horovod.torch as hvd
assert hvd.gloo_built(), "Horovod was built without gloo"
import horovod
print(f"horovod {horovod.__version__} (torch ops, gloo) and", end=" ")
import tensorflow as tf
print(f"tensorflow {tf.__version__} installed")
EOF
