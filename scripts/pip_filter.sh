# Sourced by the *_env.sh scripts; defines resolver_filter.
#
# Some packages (vLLM, SGLang, vLLM-Omni, torchvision, this project) are installed with --no-deps
# on purpose, so every later install makes pip's resolver print a block ("ERROR: pip's dependency
# resolver does not currently take into account ...") listing their pins that are absent or
# differ. pip still exits 0 for it. resolver_filter replaces that block with one line; every
# other line of pip's output, and pip's exit status (under pipefail), pass through unchanged, so
# real failures stay visible and fatal. Use: `pip ... 2>&1 | resolver_filter >&2`.
resolver_filter() {
  awk '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { block = 1; next }
    block && / requires | has requirement / { n++; next }
    { if (block) { flush() }; print; fflush() }
    function flush() {
      printf "note: pip lists %d unmet pins of packages installed with --no-deps (expected; the import check below decides)\n", n
      block = 0; n = 0
    }
    END { if (block) flush() }
  '
}
