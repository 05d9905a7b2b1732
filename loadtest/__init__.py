"""Prism's load tester: workloads, arrival processes, statistics and reports."""
