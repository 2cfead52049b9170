#!/bin/sh
# Print a working Python interpreter of version $1 (e.g. 3.12), or exit 1 if there is none:
# pythonX.Y on PATH (a pyenv shim of an inactive version does not count: it must run), else one of pyenv's.
want="$1"
pyenv_root=$(pyenv root 2>/dev/null) || pyenv_root=""
for candidate in "python$want" "$pyenv_root/versions/$want"*/bin/"python$want"; do
    path=$(command -v "$candidate" 2>/dev/null) || continue
    if "$path" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
        >/dev/null 2>&1; then
        echo "$path"
        exit 0
    fi
done
exit 1
