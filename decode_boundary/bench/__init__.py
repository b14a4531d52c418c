"""Benchmarking, in one place: the baselines a user could assemble
(``baselines``), the registry of benchmarked paths (``paths``), the
per-rank verify-then-time harness of ``decode-boundary bench`` (``harness``),
the GEMM timings and table (``gemm``), the tuner of the tactic tables
(``tune``), and the tables / JSON / PNG
(``report``). Every time comes from the one timer, ``bench.timing`` (CUDA
graphs of back-to-back calls, weights rotated so L2 holds none, medians).
Above the model chain; only the CLI and ``benchmarks/`` import it."""
