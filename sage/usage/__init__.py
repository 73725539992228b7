"""Spending: the usage ledger, budgets per principal, and the Prometheus metrics."""
