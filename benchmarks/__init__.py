"""Speed and memory measurements of rloo_lightning (not part of the installed package).

A package so that its scripts share :mod:`benchmarks.bench_common` from wherever they run, and so that
``python -m benchmarks <name> [args]`` (from the repository's root) runs any of them: see ``__main__.py`` and
``benchmarks/README.md``.
"""
