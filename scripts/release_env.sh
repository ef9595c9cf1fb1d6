#!/usr/bin/env bash
# release_deepspeed_env VERSION VENV: a virtual environment VENV, activated, holding DeepSpeed VERSION
# (from PyPI, its source distribution) and reading everything else (torch 2.13.0 CPU, DeepSpeed's
# requirements, this package, the test tools) from the main environment QGZ_VENV made by
# scripts/setup_env.sh: one torch install for every release.
# Its own DeepSpeed comes first on sys.path; its deepspeed_qgz.pth appends the main environment's
# site-packages and then starts the overlay, as the main environment's .pth does. It is written after
# pip has run, so that pip never sees (or uninstalls) the main environment's DeepSpeed; the main
# environment's commands come after its own on PATH. DeepSpeed's ops
# build in a cache of its own (TORCH_EXTENSIONS_DIR): another release's ops have the same names from
# other sources. This package's quantizer op is the main environment's build, linked there: the same
# source, torch and flags on every release (deepspeed_qgz/cpu_quantizer.py), so no release builds it
# again. Sourced by scripts/run_3x2.sh and scripts/releases_check.sh; needs ROOT and say
# (scripts/setup_env.sh, sourced first).
release_deepspeed_env() {
    local main_site main_bin main_op
    main_site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    main_bin=$(dirname "$(command -v python)")
    # where torch builds it in the main environment (made if missing; DeepSpeed logs on standard output)
    main_op=$(python -c 'from torch.utils.cpp_extension import _get_build_directory
from deepspeed_qgz.cpu_quantizer import QuantizerBuilder
print(_get_build_directory(QuantizerBuilder.NAME, False))' | tail -1)
    if [ ! -x "$2/bin/python" ]; then
        say "environment: DeepSpeed $1 in $2, torch and the tools from $(dirname "$(dirname "$(dirname "$main_site")")")"
        python3 -m venv "$2"
    fi
    # shellcheck disable=SC1091
    source "$2/bin/activate"
    # the main environment's tools after its own: its ninja above all, which built the op; another
    # (the system's 1.11 beside its 1.13) takes that build for out of date and builds it again
    export PATH="$2/bin:$main_bin:${PATH#"$2/bin:"}"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    local site
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -f "$site/deepspeed_qgz.pth"
    export TORCH_EXTENSIONS_DIR="$2/torch_extensions"
    local op_link
    op_link="$TORCH_EXTENSIONS_DIR/$(basename "$main_op")"
    [ -L "$op_link" ] || rm -rf "$op_link"  # a build of its own, from before
    mkdir -p "$TORCH_EXTENSIONS_DIR"
    ln -sfn "$main_op" "$op_link"
    pip install -q --no-deps "deepspeed==$1"
    printf '%s\nimport deepspeed_qgz._startup\n' "$main_site" >"$site/deepspeed_qgz.pth"
    local installed
    installed=$(python -c 'from importlib.metadata import version; print(version("deepspeed"))')
    [ "$installed" = "$1" ] || { say "environment: DeepSpeed $installed installed in $2, not $1"; return 1; }
}
