#!/usr/bin/env sh
# Print the path of a Python >= 3.12 (jax 0.11.2 needs it), or fail with a clear message.
# Tries $PYTHON, python3.x on PATH, then pyenv's installed versions.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for c in "${PYTHON:-}" python3.14 python3.13 python3.12 python3 \
         $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then "$p" -c 'import sys; print(sys.executable)'; exit 0; fi
done
echo "error: hla_jax needs Python >= 3.12 (jax 0.11.2) and none was found;" \
     "install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
