"""Benchmarks for sage: ``make bench`` runs them all and prints one table.

Each ``bench_*.py`` module has ``run(report)``; it measures and adds rows,
putting the reference (what the issue compares against) in the same row, so
the ratio is computed from figures taken in the same run.
"""
