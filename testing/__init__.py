"""What tests and benchmarks start: a local stack of real services
(stack.py) and a throwaway Redis (redis_server.py). Not imported by the
product: above the launcher (prism/) in tests/unit/test_layering.py's order."""
