"""lightning_paci's benchmarks: ``python -m benchmarks <name> [options]`` (``python -m benchmarks --help`` lists them).

Each benchmark answers one question a user asks before choosing this strategy -- how much faster than
torch.distributed.pipelining, how soon a given loss is reached, what data parallelism and memory cost, what the
framework itself costs per micro-batch -- on the machine at hand. The shared command line, tables, JSON records
and the emulated cluster are in ``benchmarks.harness``; current figures in ``benchmarks/RESULTS.md``, the dated
measurements behind them in ``benchmarks/reports/``.
"""
