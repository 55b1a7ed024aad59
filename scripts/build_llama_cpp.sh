#!/usr/bin/env bash
# Build llama.cpp (libllama + llama-server) from the llama-cpp-python sdist on PyPI and install its Python bindings
# into the venv without a second build. Called by `make`; safe to rerun (a finished build is reused).
#
# Why not `pip install llama-cpp-python`: PyPI has only the sdist; pip would build every tool (slower) and no
# llama-server, and a wheel built with -march=native and cached by pip could later load on another CPU. Here the
# build lives in a cache folder keyed by the package version and this CPU's flags, so a fresh clone on the same
# machine reuses it and another CPU builds its own.
#
# usage: scripts/build_llama_cpp.sh <venv python>
# env:   SLIMWISE_LLAMA_CPP_CACHE (default ~/.cache/slimwise_train), LLAMA_CPP_JOBS (default: nproc)
set -euo pipefail
PY=${1:?usage: build_llama_cpp.sh <venv python>}
VERSION=0.3.36
CACHE=${SLIMWISE_LLAMA_CPP_CACHE:-$HOME/.cache/slimwise_train}
CPU_KEY=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
HOME_DIR=$CACHE/llama.cpp-$VERSION-$CPU_KEY
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
SRC=$HOME_DIR/llama_cpp_python-$VERSION
BUILD=$HOME_DIR/build
JOBS=${LLAMA_CPP_JOBS:-$(nproc)}

# ninja's "[n/N] ..." lines -> one line every 25 steps. A bash loop, not awk: mawk block-buffers a pipe and would
# print its lines in bursts minutes late.
progress() {
    local line n total
    while IFS= read -r line; do
        if [[ $line =~ ^\[([0-9]+)/([0-9]+)\] ]]; then
            n=${BASH_REMATCH[1]}; total=${BASH_REMATCH[2]}
            if (( n % 25 == 0 || n == total )); then echo "llama.cpp: step $n of $total"; fi
        fi
    done
    return 0
}

mkdir -p "$HOME_DIR"
if [ ! -f "$SDIST" ]; then
    echo "llama.cpp: downloading the llama-cpp-python $VERSION sdist (76 MB)"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
fi
if [ ! -f "$SRC/.unpacked" ]; then
    rm -rf "$SRC"
    tar xzf "$SDIST" -C "$HOME_DIR"
    touch "$SRC/.unpacked"
fi

if [ ! -f "$BUILD/.built" ]; then
    # CMake (and Ninja) from PyPI into the venv where the machine has none: the build needs nothing else but a C++
    # compiler, which DeepSpeed's CPU op already needs.
    if ! command -v cmake >/dev/null; then
        echo "llama.cpp: no cmake on PATH, installing cmake and ninja from PyPI into the venv"
        "$PY" -m pip install --quiet cmake ninja
        PATH="$(dirname "$PY"):$PATH"
    fi
    echo "llama.cpp: building libllama + llama-server with $JOBS jobs into $BUILD (about 5-10 min on 2 cores, once per CPU kind; log: $HOME_DIR/build.log)"
    start=$(date +%s)
    generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    # RPATH $ORIGIN: llama-server finds its shared libraries beside itself.
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${generator[@]}" "${launcher[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DCMAKE_BUILD_RPATH='$ORIGIN' \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_APP=OFF > "$HOME_DIR/build.log" 2>&1 \
        || { tail -30 "$HOME_DIR/build.log"; exit 1; }
    # A progress line every 25 compile steps, so a 15-minute build is not silent.
    set +o pipefail
    cmake --build "$BUILD" -j "$JOBS" --target llama llama-server 2>&1 | tee -a "$HOME_DIR/build.log" | progress
    status=${PIPESTATUS[0]}
    set -o pipefail
    [ "$status" -eq 0 ] || { tail -30 "$HOME_DIR/build.log"; exit 1; }
    [ -f "$BUILD/bin/libllama.so" ] && [ -x "$BUILD/bin/llama-server" ] || { echo "llama.cpp: build finished without bin/libllama.so and bin/llama-server"; exit 1; }
    touch "$BUILD/.built"
    echo "llama.cpp: built in $(( $(date +%s) - start )) s"
fi

# The Python bindings only (ctypes over the libllama built above); pip caches this small wheel.
if ! "$PY" -c "import importlib.metadata as m; assert m.version('llama_cpp_python') == '$VERSION'" 2>/dev/null; then
    echo "llama.cpp: installing the llama-cpp-python $VERSION bindings (no second build)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --quiet "$SDIST"
fi
# Where slimwise_train.serve finds libllama, llama-server and llama.cpp's own converter (one line, read at import).
"$PY" -c "import sys, pathlib; pathlib.Path(sys.prefix, 'slimwise-llama-cpp-home').write_text(sys.argv[1] + '\n')" "$HOME_DIR"
echo "llama.cpp: ready in $HOME_DIR"
