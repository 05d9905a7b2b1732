"""Operations: the Prometheus metrics, the dashboard's window, the event
loop probe, and the worker processes and their line to each other. The lowest
room above the gateway's base (config.py, errors.py, timing.py): every other
room may import it, and it imports none of them."""
