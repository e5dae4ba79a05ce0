"""mptrain's benchmarks: scripts that measure and write JSON documents (BENCHMARKS.md holds the
figures). A package, run from the repository root as ``python -m benchmarks.NAME``; the scripts
import each other as ``benchmarks.NAME`` and mptrain's internals through
:mod:`benchmarks.mptrain_api` only. Not installed with mptrain.
"""
