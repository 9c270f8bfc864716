#!/usr/bin/env bash
# MLX's CUDA wheels for a device machine that reaches no registry (bench/accelerator.py;
# the procedure: docs/performance.md, "On an NVIDIA GPU").
#
#   bash bench/accelerator_wheels.sh prepare   # here: download, split into .whl-a and .whl-b (.gitignore)
#   bash bench/accelerator_wheels.sh install   # there: reassemble, check, install into /tmp/site
#
# mlx-cuda-13 is a 90 MB wheel and one device call carries at most 64 MiB with the working
# tree, so it travels in two halves over two calls made back to back (a warm machine keeps
# what the first left). The device image already holds the CUDA 13 libraries it needs
# (nvidia-cublas, -cudnn-cu13, -nccl-cu13, -cufft, -cusolver, -cuda-nvrtc, -cuda-runtime)
# and mlx-lm's needs (transformers, sentencepiece, protobuf, pyyaml, jinja2), and monolith's
# that the bench imports (numpy, tokenizers, filelock, tqdm, safetensors).
set -euo pipefail
VERSION=0.32.4
LM_VERSION=0.32.2
SITE=/tmp/site
KEEP=/tmp/accelerator-wheels  # the first half, also outside the checkout
cd "$(dirname "$0")/.."

prepare() {
    rm -rf .whl-a .whl-b && mkdir -p .whl-a .whl-b
    local tmp
    tmp=$(mktemp -d)
    local plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
        -d "$tmp" "mlx==$VERSION" "mlx-cuda-13==$VERSION" "mlx-lm==$LM_VERSION"
    local cuda
    cuda=$(basename "$tmp"/mlx_cuda_13-*.whl)
    (cd "$tmp" && sha256sum "$cuda" > cuda.sha256 && split -n 2 -d "$cuda" "$cuda.part")
    mv "$tmp/$cuda.part00" "$tmp"/mlx-"$VERSION"-*.whl .whl-a/
    mv "$tmp/$cuda.part01" "$tmp/cuda.sha256" "$tmp"/mlx_lm-*.whl .whl-b/
    rm -rf "$tmp"
    du -sh .whl-a .whl-b
}

install() {
    local a
    for a in .whl-a "$KEEP" ""; do ls "$a"/*.part00 > /dev/null 2>&1 && break; done
    [ -n "$a" ] || { echo "the first half is gone (the machine went cold): make both calls again" >&2; exit 3; }
    local tmp
    tmp=$(mktemp -d)
    local cuda
    cuda=$(cut -d' ' -f3 < .whl-b/cuda.sha256)
    cat "$a/$cuda.part00" ".whl-b/$cuda.part01" > "$tmp/$cuda"
    (cd "$tmp" && sha256sum -c --quiet "$OLDPWD/.whl-b/cuda.sha256")
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$tmp/$cuda" "$a"/mlx-*.whl .whl-b/mlx_lm-*.whl
    rm -rf "$tmp"
    # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia/...: the image's own
    local nvidia
    nvidia=$(python3 -c 'import nvidia, os; print(next(p for p in nvidia.__path__ if any(
        os.path.isdir(os.path.join(p, d)) for d in ("cu13", "cublas"))))')
    ln -sfn "$nvidia" "$SITE/nvidia"
    ! ldd "$SITE/mlx/lib/libmlx.so" | grep "not found" || echo "(libraries not found: see above)" >&2
    PYTHONPATH=$SITE python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, "cuda", mx.cuda.is_available(), mx.default_device(), mx.device_info().get("device_name"))'
}

keep() {  # the first call: the first half outside the checkout too
    mkdir -p "$KEEP" && cp .whl-a/* "$KEEP"/ && ls -la "$KEEP"
}

"${1:?prepare, keep or install}"
