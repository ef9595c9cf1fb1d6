#!/usr/bin/env bash
# release_deepspeed_env VERSION VENV: a virtual environment VENV, activated, holding DeepSpeed VERSION
# (from PyPI, its source distribution) and reading everything else (torch 2.13.0 CPU, DeepSpeed's
# requirements, this package, the test tools) from the main environment QGZ_VENV made by
# scripts/setup_env.sh: one torch install and one build of this package's CPU op for every release.
# Its own DeepSpeed comes first on sys.path; its deepspeed_qgz.pth appends the main environment's
# site-packages and then starts the overlay, as the main environment's .pth does. It is written after
# pip has run, so that pip never sees (or uninstalls) the main environment's DeepSpeed. Ops build in a
# cache of its own (TORCH_EXTENSIONS_DIR): another release's ops have the same names, and a build
# shared by two releases is rebuilt at every switch. This package's quantizer op is the one source
# with every release: its build in the main environment's cache is copied in, timestamps kept, and
# ninja rebuilds it only where a release's builder compiles it with other flags (a minute and a half
# a release saved). Sourced by scripts/run_3x2.sh and scripts/releases_check.sh; needs ROOT and say
# (scripts/setup_env.sh, sourced first), and the main environment's TORCH_EXTENSIONS_DIR as it was
# when sourced.
MAIN_TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR-unset}
# where torch builds this package's quantizer op (the last line: DeepSpeed logs on standard output)
quantizer_op_build_dir() {
    python -c 'from torch.utils.cpp_extension import _get_build_directory
from deepspeed_qgz.cpu_quantizer import QuantizerBuilder
print(_get_build_directory(QuantizerBuilder.NAME, False))' | tail -1
}
release_deepspeed_env() {
    local main_site main_op
    main_site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    main_op=$(if [ "$MAIN_TORCH_EXTENSIONS_DIR" = unset ]; then unset TORCH_EXTENSIONS_DIR; else
        export TORCH_EXTENSIONS_DIR=$MAIN_TORCH_EXTENSIONS_DIR; fi
        quantizer_op_build_dir)
    if [ ! -x "$2/bin/python" ]; then
        say "environment: DeepSpeed $1 in $2, torch and the tools from $(dirname "$(dirname "$(dirname "$main_site")")")"
        python3 -m venv "$2"
    fi
    # shellcheck disable=SC1091
    source "$2/bin/activate"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    local site
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -f "$site/deepspeed_qgz.pth"
    export TORCH_EXTENSIONS_DIR="$2/torch_extensions"
    pip install -q --no-deps "deepspeed==$1"
    printf '%s\nimport deepspeed_qgz._startup\n' "$main_site" >"$site/deepspeed_qgz.pth"
    local op_dir
    op_dir=$(quantizer_op_build_dir)
    if [ -d "$main_op" ] && [ ! -e "$op_dir" ]; then
        mkdir -p "$(dirname "$op_dir")"
        cp -a "$main_op" "$op_dir"
        rm -f "$op_dir/lock"
    fi
    local installed
    installed=$(python -c 'from importlib.metadata import version; print(version("deepspeed"))')
    [ "$installed" = "$1" ] || { say "environment: DeepSpeed $installed installed in $2, not $1"; return 1; }
}
