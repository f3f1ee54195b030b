# Sourced by setup.sh and lock.sh: where uv finds packages. uv does not read pip's configuration, so
# the find-links and indexes of this machine's (pip config list: pip.conf, PIP_* variables) are passed
# on; for ENGINE=cpu, PyTorch's CPU index (TORCH_CPU_INDEX) too, where it answers, for torch 2.13.0+cpu.
# Sets UV_SOURCES (an array of uv options); $1 is the engine (cpu or gpu), $2 the Python to ask pip.
uv_sources() {
  local engine="$1" python="$2" key value index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  UV_SOURCES=(--index-strategy unsafe-best-match)
  while IFS="=" read -r key value; do
    value="${value#\'}" value="${value%\'}"
    case "$key" in
      # A find-links folder may hold torch 2.13.0+cpu, which `torch==2.13.0` (the GPU pin) also
      # matches and uv would rank first: left out for ENGINE=gpu.
      *.find-links) [ "$engine" = gpu ] || for v in $value; do UV_SOURCES+=(--find-links "$v"); done ;;
      *.index-url) UV_SOURCES+=(--default-index "$value") ;;
      *.extra-index-url) for v in $value; do UV_SOURCES+=(--index "$v"); done ;;
    esac
  done < <("$python" -m pip config list 2>/dev/null | sort -u)
  if [ "$engine" = cpu ]; then
    if "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$index" 2>/dev/null; then
      UV_SOURCES+=(--index "$index")
    else
      echo "setup: $index does not answer; torch comes from the other sources (set TORCH_CPU_INDEX to a mirror)"
    fi
  fi
}
